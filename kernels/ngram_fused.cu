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
// * The copy is embed_from_argmax.cu's: 16-byte vectors with four loads in flight per lane when
//   td % 8 == 0 and the addresses allow it, fp8 rows as 8-byte loads dequantised into 16-byte
//   stores, element-wise otherwise (any td). fp8 dequantisation is bf16(f32(e4m3) * scale) with
//   one f32 product (no FMA) and one rounding to bf16, as layers/reference.py reproduces.
//
// The kernel cannot see a table's size: the host guarantees 1 <= M_c < 2**32 rows per hashed
// table and in-range slots for cached ones.
#include "common.cuh"

namespace {

constexpr uint32_t kWarp = 32;
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

// Copy `count` items of type V from src to dst, one warp, four loads in flight per lane.
template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ src, V* __restrict__ dst,
                                          uint32_t count, uint32_t lane) {
    uint32_t i = lane;
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

__device__ __forceinline__ void copy_bf16_row(const bf16* table, uint32_t id, bf16* dst,
                                              uint32_t td, uint32_t lane) {
    const bf16* src = table + static_cast<uint64_t>(id) * td;
    if (td % 8 == 0 && aligned16(table, dst)) {
        warp_copy(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), td / 8, lane);
    } else {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        for (uint32_t j = lane; j < td; j += kWarp) d[j] = __ldg(s + j);
    }
}

__device__ __forceinline__ void copy_fp8_row(const uint8_t* table, const float* row_scale,
                                             uint32_t id, bf16* dst, uint32_t td, uint32_t lane) {
    const uint8_t* src = table + static_cast<uint64_t>(id) * td;
    const float scale = __ldg(row_scale + id);
    const bool vec = td % 8 == 0 && (reinterpret_cast<uintptr_t>(table) & 7) == 0 &&
                     (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
    if (vec) {
        const uint2* s = reinterpret_cast<const uint2*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint32_t count = td / 8;
        uint32_t j = lane;
        for (; j + kWarp < count; j += 2 * kWarp) {
            const uint2 a = __ldg(s + j), b = __ldg(s + j + kWarp);
            d[j] = dequant8(a, scale);
            d[j + kWarp] = dequant8(b, scale);
        }
        for (; j < count; j += kWarp) d[j] = dequant8(__ldg(s + j), scale);
    } else {
        for (uint32_t j = lane; j < td; j += kWarp) dst[j] = dequant(__ldg(src + j), scale);
    }
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
            copy_bf16_row(reinterpret_cast<const bf16*>(data), id, dst, td, lane);
        } else {
            copy_fp8_row(reinterpret_cast<const uint8_t*>(data),
                         reinterpret_cast<const float*>(scale), id, dst, td, lane);
        }
    }
}
