// Fused n-gram hash and gather: every table's id computed from the tokens on the GPU, and every
// table's row copied into one [R, T*td] bf16 buffer that a single GEMM then consumes.
//
// Why this shape:
// * One warp per (output row r, table c) pair, pairs in order i = r*T + c and grid-strided, so
//   consecutive warps write consecutive td-element pieces of the output (out row r is the T
//   gathered rows side by side) and any R*T fits a capped grid.
// * The hash is a handful of 64-bit modular products (N terms, N small), cheap next to the row
//   copy, so lane d takes term d (32 terms at a time when N > 32) and a ballot finds the first
//   look-back cut; every term is reduced below M_c < 2**32 before the warp sum, so the sum of 32
//   terms plus the running residue stays far below 2**64. Tokens < 2**32 times V**d mod M_c
//   < 2**32 fit 64 bits, so no product needs more. The look-back rule is layers/ngram_embed/ids.py:
//   d = 0 always counts; the first d >= 1 whose token is before the context start (0xFFFFFFFF)
//   or is the EOS ends the n-gram there (that term and all later ones contribute 0).
// * Cached tables (flag bit 0) take their row from slots[r*T + c] instead of the hash: their rows
//   live in a row-cache arena, not in a table of M_c rows.
// * The row copy is row_copy.cuh's, shared with embed_from_argmax.cu (vector paths when td and
//   the addresses allow, element-wise otherwise; fp8 dequantised with one rounding).
//
// The kernel cannot see a table's size: the host guarantees 1 <= M_c < 2**32 rows per hashed
// table and in-range slots for cached ones.
#include "row_copy.cuh"

namespace {

using rows::kWarp;
constexpr uint32_t kFull = 0xffffffffu;
constexpr uint32_t kNoToken = 0xffffffffu;  // window entry before the context start
constexpr uint64_t kCached = 1;             // tables[c*4 + 3] bit 0

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
    return v;
}

// (sum_{d < n} w[d] * pows[d]) mod m, cut at the first d >= 1 with w[d] == kNoToken or eos.
// Called by all 32 lanes of a warp; every lane returns the id.
__device__ uint32_t hash_id(const uint32_t* w, const uint64_t* pows, uint32_t n, uint64_t m,
                            uint32_t eos, uint32_t lane) {
    uint64_t acc = 0;
    for (uint32_t base = 0; base < n; base += kWarp) {
        const uint32_t d = base + lane;
        uint32_t tok = 0;
        bool stop = false;
        if (d < n) {
            tok = __ldg(w + d);
            stop = d > 0 && (tok == kNoToken || tok == eos);
        }
        const uint32_t stops = __ballot_sync(kFull, stop);
        const uint32_t cut = stops ? static_cast<uint32_t>(__ffs(static_cast<int>(stops))) - 1 : kWarp;
        uint64_t term = 0;
        if (d < n && lane < cut) term = static_cast<uint64_t>(tok) * __ldg(pows + d) % m;
        acc = (acc + warp_sum(term)) % m;
        if (stops) break;
    }
    return static_cast<uint32_t>(acc);
}

}  // namespace

// out[r, c*td + j] = row id_c(r) of table c, element j; ids_out[r*T + c] = id_c(r) when given.
extern "C" __global__ void ngram_gather(const uint32_t* windows, const uint64_t* tables,
                                        const uint64_t* pows, const uint32_t* slots, bf16* out,
                                        uint32_t* ids_out, uint32_t rows_r, uint32_t num_tables,
                                        uint32_t max_ngram, uint32_t splits, uint32_t td,
                                        uint32_t eos) {
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t pairs = static_cast<uint64_t>(rows_r) * num_tables;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    uint64_t i = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    for (; i < pairs; i += warps) {  // warp-uniform: the hash's ballots see all 32 lanes
        const uint64_t r = i / num_tables;
        const uint32_t c = static_cast<uint32_t>(i - r * num_tables);
        const uint64_t* t = tables + 4 * static_cast<uint64_t>(c);
        const uint64_t data = __ldg(t), scale = __ldg(t + 1), rows = __ldg(t + 2);
        const uint32_t id = (__ldg(t + 3) & kCached)
            ? __ldg(slots + i)
            : hash_id(windows + r * max_ngram, pows + static_cast<uint64_t>(c) * max_ngram,
                      c / splits + 2, rows, eos, lane);
        if (ids_out != nullptr && lane == 0) ids_out[i] = id;
        bf16* dst = out + i * td;
        if (scale == 0) {
            const bf16* table = reinterpret_cast<const bf16*>(data);
            rows::copy_bf16_row(table + static_cast<uint64_t>(id) * td, dst, td,
                                rows::bf16_vec(table, out, td), lane);
        } else {
            const uint8_t* table = reinterpret_cast<const uint8_t*>(data);
            rows::copy_fp8_row(table + static_cast<uint64_t>(id) * td,
                               __ldg(reinterpret_cast<const float*>(scale) + id), dst, td,
                               rows::fp8_vec(table, out, td), lane);
        }
    }
}
