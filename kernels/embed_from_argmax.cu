// Embedding gathers: bf16 rows, fp8 rows with a per-row scale, and greedy argmax-then-embed.
//
// The gathers are memory-bound: one warp copies one row at a time (rows grid-strided over the
// warps of the grid) through row_copy.cuh: 16-byte chunks when dim and the bases allow it,
// element-wise otherwise, correct for every size.
//
// Nothing here knows a table's row count: ids are validated on the host before a launch (the
// shard gather bounds its ids by the shard's rows itself).
#include "row_copy.cuh"

namespace {

using row_copy::global_warp;
using row_copy::kWarp;
using row_copy::warp_count;
__device__ __forceinline__ uint32_t lane() { return threadIdx.x % kWarp; }

}  // namespace

// out[i, :] = table[ids[i], :]
extern "C" __global__ void batched_embed(const uint32_t* ids, const bf16* table, bf16* out,
                                         uint32_t n, uint32_t dim) {
    const bool vec = row_copy::bf16_vec(table, out, dim);
    for (uint64_t row = global_warp(); row < n; row += warp_count()) {
        const uint64_t id = ids[row];
        row_copy::copy_bf16_row(table + id * dim, out + static_cast<uint64_t>(row) * dim, dim,
                                vec, row_copy::Warp{lane()});
    }
}

// A vocabulary shard's gather (tensor parallelism): out[i, :] = table[ids[i] - lo, :] for the ids
// this rank holds (lo <= id < lo + count), zeros for the others (the all-reduce brings them).
extern "C" __global__ void batched_embed_shard(const uint32_t* ids, const bf16* table, bf16* out,
                                               uint32_t n, uint32_t dim, uint32_t lo,
                                               uint32_t count) {
    const bool vec = row_copy::bf16_vec(table, out, dim);
    for (uint64_t row = global_warp(); row < n; row += warp_count()) {
        const uint32_t id = ids[row] - lo;  // wraps below lo: out of range too
        bf16* dst = out + static_cast<uint64_t>(row) * dim;
        if (id < count) {
            row_copy::copy_bf16_row(table + static_cast<uint64_t>(id) * dim, dst, dim, vec,
                                    row_copy::Warp{lane()});
        } else {
            for (uint32_t j = lane(); j < dim; j += kWarp) dst[j] = __float2bfloat16(0.0f);
        }
    }
}

// out[i, j] = bf16(float(table[ids[i], j]) * row_scale[ids[i]])
extern "C" __global__ void batched_embed_fp8(const uint32_t* ids, const fp8* table,
                                             const float* row_scale, bf16* out, uint32_t n,
                                             uint32_t dim) {
    const bool vec = row_copy::fp8_vec(table, out, dim);
    for (uint64_t row = global_warp(); row < n; row += warp_count()) {
        const uint64_t id = ids[row];
        row_copy::copy_fp8_row(reinterpret_cast<const uint8_t*>(table) + id * dim,
                               __ldg(row_scale + id), out + static_cast<uint64_t>(row) * dim, dim,
                               vec, row_copy::Warp{lane()});
    }
}

// Greedy decode without a host round trip: per row of logits [m, vocab], the argmax id
// (lowest index on ties, NaN never wins; an all-NaN row gives id 0) goes to ids_out[row] and
// its embedding row to out[row]. One block per row; launch with a power-of-two block size.
namespace {

struct Best {
    float v;
    uint32_t i;
};

__device__ __forceinline__ Best better(Best a, Best b) {
    // NaN compares false both ways, so it can never replace a candidate.
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}

__device__ __forceinline__ void consider(Best& best, float v, uint32_t i) {
    if (v > best.v || (v == best.v && i < best.i)) best = Best{v, i};
}

}  // namespace

extern "C" __global__ void embed_from_argmax_bf16(const bf16* logits, uint32_t vocab,
                                                  const bf16* table, bf16* out,
                                                  uint32_t* ids_out, uint32_t m, uint32_t dim) {
    __shared__ Best warp_best[32];
    __shared__ uint32_t chosen;
    const uint32_t row = blockIdx.x;
    if (row >= m) return;
    const bf16* x = logits + static_cast<uint64_t>(row) * vocab;
    Best best{__int_as_float(0xff800000), 0xffffffffu};  // -inf, "none yet"
    if (vocab % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        for (uint32_t c = threadIdx.x; c < vocab / 8; c += blockDim.x) {
            const uint4 q = __ldg(x4 + c);
            const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                consider(best, __uint_as_float(w[j] << 16), c * 8 + 2 * j);
                consider(best, __uint_as_float(w[j] & 0xffff0000u), c * 8 + 2 * j + 1);
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x)
            consider(best, __bfloat162float(x[i]), i);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        Best other{__shfl_xor_sync(0xffffffffu, best.v, off),
                   __shfl_xor_sync(0xffffffffu, best.i, off)};
        best = better(best, other);
    }
    if (lane() == 0) warp_best[threadIdx.x / kWarp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        Best b = warp_best[0];
        for (uint32_t w = 1; w < blockDim.x / kWarp; ++w) b = better(b, warp_best[w]);
        chosen = b.i == 0xffffffffu ? 0u : b.i;
        ids_out[row] = chosen;
    }
    __syncthreads();
    const uint64_t id = chosen;
    row_copy::copy_bf16_row(table + id * dim, out + static_cast<uint64_t>(row) * dim, dim,
                            row_copy::bf16_vec(table, out, dim), row_copy::Block{});
}
