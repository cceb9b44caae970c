// Embedding gathers: bf16 rows, fp8 rows with a per-row scale, and greedy argmax-then-embed.
//
// Memory-bound: one warp copies one row at a time (rows grid-strided over the warps of the
// grid), lanes take consecutive 16-byte chunks so each warp instruction moves 512 contiguous
// bytes, and four chunks per lane are loaded before the first store so enough bytes are in
// flight. The 16-byte path needs dim % 8 == 0 and 16-byte aligned tables and outputs; anything
// else takes the element-wise path, which is slower but correct for every size.
//
// Nothing here knows a table's row count: ids are validated on the host before a launch.
#include "common.cuh"

namespace {

constexpr uint32_t kWarp = 32;

__device__ __forceinline__ uint32_t global_warp() {
    return (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
}
__device__ __forceinline__ uint32_t warp_count() { return gridDim.x * blockDim.x / kWarp; }
__device__ __forceinline__ uint32_t lane() { return threadIdx.x % kWarp; }

// Copy `count` items of type V from src to dst, one warp, four loads in flight per lane.
template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ src, V* __restrict__ dst,
                                          uint32_t count) {
    uint32_t i = lane();
    for (; i + 3 * kWarp < count; i += 4 * kWarp) {
        V a = __ldg(src + i), b = __ldg(src + i + kWarp);
        V c = __ldg(src + i + 2 * kWarp), d = __ldg(src + i + 3 * kWarp);
        dst[i] = a;
        dst[i + kWarp] = b;
        dst[i + 2 * kWarp] = c;
        dst[i + 3 * kWarp] = d;
    }
    for (; i < count; i += kWarp) dst[i] = __ldg(src + i);
}

__device__ __forceinline__ void copy_bf16_row(const bf16* src, bf16* dst, uint32_t dim, bool vec) {
    if (vec) {
        warp_copy(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), dim / 8);
    } else {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        for (uint32_t i = lane(); i < dim; i += kWarp) d[i] = s[i];
    }
}

// fp8 -> f32 is exact; the product is rounded once to f32 (no FMA), then once to bf16.
__device__ __forceinline__ bf16 dequant(uint8_t bits, float scale) {
    __nv_fp8_e4m3 v;
    v.__x = bits;
    return __float2bfloat16_rn(__fmul_rn(static_cast<float>(v), scale));
}

__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

__device__ __forceinline__ uint4 dequant8(uint2 q, float s) {
    uint4 r;
    r.x = pack_bf16x2(dequant(q.x & 0xff, s), dequant((q.x >> 8) & 0xff, s));
    r.y = pack_bf16x2(dequant((q.x >> 16) & 0xff, s), dequant(q.x >> 24, s));
    r.z = pack_bf16x2(dequant(q.y & 0xff, s), dequant((q.y >> 8) & 0xff, s));
    r.w = pack_bf16x2(dequant((q.y >> 16) & 0xff, s), dequant(q.y >> 24, s));
    return r;
}

}  // namespace

// out[i, :] = table[ids[i], :]
extern "C" __global__ void batched_embed(const uint32_t* ids, const bf16* table, bf16* out,
                                         uint32_t n, uint32_t dim) {
    const bool vec = (dim % 8 == 0) && aligned16(table, out);
    for (uint32_t row = global_warp(); row < n; row += warp_count()) {
        const uint64_t id = ids[row];
        copy_bf16_row(table + id * dim, out + static_cast<uint64_t>(row) * dim, dim, vec);
    }
}

// out[i, j] = bf16(float(table[ids[i], j]) * row_scale[ids[i]])
extern "C" __global__ void batched_embed_fp8(const uint32_t* ids, const fp8* table,
                                             const float* row_scale, bf16* out, uint32_t n,
                                             uint32_t dim) {
    const bool vec = (dim % 8 == 0) && ((reinterpret_cast<uintptr_t>(table) & 7) == 0) &&
                     ((reinterpret_cast<uintptr_t>(out) & 15) == 0);
    for (uint32_t row = global_warp(); row < n; row += warp_count()) {
        const uint64_t id = ids[row];
        const float scale = __ldg(row_scale + id);
        bf16* dst = out + static_cast<uint64_t>(row) * dim;
        if (vec) {
            const uint2* src = reinterpret_cast<const uint2*>(table + id * dim);
            uint4* d = reinterpret_cast<uint4*>(dst);
            const uint32_t count = dim / 8;
            uint32_t i = lane();
            for (; i + kWarp < count; i += 2 * kWarp) {
                uint2 a = __ldg(src + i), b = __ldg(src + i + kWarp);
                d[i] = dequant8(a, scale);
                d[i + kWarp] = dequant8(b, scale);
            }
            for (; i < count; i += kWarp) d[i] = dequant8(__ldg(src + i), scale);
        } else {
            const uint8_t* src = reinterpret_cast<const uint8_t*>(table + id * dim);
            for (uint32_t i = lane(); i < dim; i += kWarp) dst[i] = dequant(__ldg(src + i), scale);
        }
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
    bf16* dst = out + static_cast<uint64_t>(row) * dim;
    const bf16* src = table + id * dim;
    if (dim % 8 == 0 && aligned16(table, out)) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (uint32_t c = threadIdx.x; c < dim / 8; c += blockDim.x) d[c] = __ldg(s + c);
    } else {
        for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
    }
}
