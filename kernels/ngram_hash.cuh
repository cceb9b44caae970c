// The n-gram hash and the table-row gather shared by ngram_fused.cu (windows built on the host)
// and ngram_decode.cu (windows read from the device-resident token history).
//
// * The hash is a handful of 64-bit modular products (N terms, N small), cheap next to the row
//   copy, so lane d takes term d (32 terms at a time when N > 32) and a ballot finds the first
//   look-back cut; every term is reduced below M_c < 2**32 before the warp sum, so the sum of 32
//   terms plus the running residue stays far below 2**64. Tokens < 2**32 times V**d mod M_c
//   < 2**32 fit 64 bits, so no product needs more. The reductions divide nothing (Modulus: an
//   f64 quotient and one correction). The look-back rule is layers/ngram_embed/ids.py:
//   d = 0 always counts; the first d >= 1 whose token is before the context start (kNoToken)
//   or is the EOS ends the n-gram there (that term and all later ones contribute 0).
// * A table descriptor is 4 u64 (layers/ops/ngram_fused.py): data address, scale address (0 for
//   bf16 rows), rows M_c, flags (bit 0: cached, the row is a given arena slot, not the hash).
//   Data may be device memory or pinned host memory mapped into the device's address space
//   (NgramTable.Host): the copy is the same, the bytes come over PCIe.
#pragma once
#include "row_copy.cuh"

namespace ngram {

using row_copy::kWarp;
constexpr uint32_t kFull = 0xffffffffu;
constexpr uint32_t kNoToken = 0xffffffffu;  // window entry before the context start
constexpr uint64_t kCached = 1;             // table descriptor flags bit 0
constexpr uint64_t kAbsent = 2;             // bit 1: another rank holds the rows (zeros here)

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
    return v;
}

// x mod m for 1 <= m < 2**32 and x / m < 2**32, without a 64-bit division. The f64 quotient
// x * (1 / m) carries three roundings of at most 2**-53 each on a value below 2**32, so it is off
// by less than 2**-18: its truncation is the true quotient or one off either way, and one
// correction of the remainder gives the exact residue.
struct Modulus {
    uint64_t m;
    double inv;
    __device__ __forceinline__ explicit Modulus(uint64_t m_)
        : m(m_), inv(__drcp_rn(static_cast<double>(m_))) {}
    __device__ __forceinline__ uint64_t reduce(uint64_t x) const {
        const uint64_t q = static_cast<uint64_t>(__dmul_rn(__ull2double_rn(x), inv));
        const int64_t r = static_cast<int64_t>(x - q * m), sm = static_cast<int64_t>(m);
        return static_cast<uint64_t>(r < 0 ? r + sm : r >= sm ? r - sm : r);
    }
};

// (sum_{d < n} w(d) * pows[d]) mod m, cut at the first d >= 1 with w(d) == kNoToken or eos.
// `w(d)` is the token d positions back (only called for d < n). Called by all 32 lanes of a
// warp; every lane returns the id.
template <class Window>
__device__ uint32_t hash_id(const Window& w, const uint64_t* pows, uint32_t n, uint64_t m,
                            uint32_t eos, uint32_t lane) {
    const Modulus mod(m);  // every pows[d] < m: terms tok * pows[d] < 2**32 * m, sums < 33 * m
    uint64_t acc = 0;
    for (uint32_t base = 0; base < n; base += kWarp) {
        const uint32_t d = base + lane;
        uint32_t tok = 0;
        bool stop = false;
        if (d < n) {
            tok = w(d);
            stop = d > 0 && (tok == kNoToken || tok == eos);
        }
        const uint32_t stops = __ballot_sync(kFull, stop);
        const uint32_t cut = stops ? static_cast<uint32_t>(__ffs(static_cast<int>(stops))) - 1 : kWarp;
        uint64_t term = 0;
        if (d < n && lane < cut) term = mod.reduce(static_cast<uint64_t>(tok) * __ldg(pows + d));
        acc = mod.reduce(acc + warp_sum(term));
        if (stops) break;
    }
    return static_cast<uint32_t>(acc < m ? acc : acc % m);  // in range even for pows >= m
}

// The pairs i = c * rows + r (table c, row r) of a warp's grid-stride loop, stepped without a
// division: the warp's first pair, then `step` pairs on each time.
struct PairWalk {
    uint64_t c, dc;
    uint32_t r, dr, rows;
    __device__ __forceinline__ PairWalk(uint64_t first, uint64_t step, uint32_t rows_)
        : c(first / rows_), dc(step / rows_), r(static_cast<uint32_t>(first % rows_)),
          dr(static_cast<uint32_t>(step % rows_)), rows(rows_) {}
    __device__ __forceinline__ void next() {
        c += dc;
        if (r >= rows - dr) {  // r + dr >= rows, without overflowing 32 bits
            r -= rows - dr;
            ++c;
        } else {
            r += dr;
        }
    }
};

struct Table {
    uint64_t data, scale, rows, flags;
    __device__ __forceinline__ bool cached() const { return flags & kCached; }
    __device__ __forceinline__ bool absent() const { return flags & kAbsent; }
};

__device__ __forceinline__ Table load_table(const uint64_t* tables, uint32_t c) {
    const uint64_t* t = tables + 4 * static_cast<uint64_t>(c);
    return Table{__ldg(t), __ldg(t + 1), __ldg(t + 2), __ldg(t + 3)};
}

// dst[0:td] = row `id` of table `t` as bf16 (fp8 rows dequantised, one rounding), or zeros for
// a table another rank holds (tensor parallelism: the all-reduce brings its row); one warp.
__device__ __forceinline__ void copy_table_row(const Table& t, uint32_t id, bf16* dst,
                                               uint32_t td, uint32_t lane) {
    if (t.absent()) {
        for (uint32_t j = lane; j < td; j += kWarp) dst[j] = __float2bfloat16(0.0f);
    } else if (t.scale == 0) {
        const bf16* table = reinterpret_cast<const bf16*>(t.data);
        row_copy::copy_bf16_row(table + static_cast<uint64_t>(id) * td, dst, td,
                                row_copy::bf16_vec(table, dst, td), row_copy::Warp{lane});
    } else {
        const uint8_t* table = reinterpret_cast<const uint8_t*>(t.data);
        row_copy::copy_fp8_row(table + static_cast<uint64_t>(id) * td,
                               __ldg(reinterpret_cast<const float*>(t.scale) + id), dst, td,
                               row_copy::fp8_vec(table, dst, td), row_copy::Warp{lane});
    }
}

}  // namespace ngram
