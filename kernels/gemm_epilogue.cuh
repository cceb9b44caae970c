// Part of gemm.cu (included after its sizes): the epilogues (the fp32 value each accumulator
// becomes just before its one bf16 rounding) and the stores of c that apply them.
//
// ep.row(row, m) gives the row's epilogue, taken once per output row a thread stores (hoisted out
// of the column loops); for row >= m it is a harmless dummy (the word epilogue's reads row 0 of
// the word table, columns < n): the direct stores skip such rows, and the TMA-store path applies
// it in shared memory but its store clips the rows off. Its
// apply(col, v) maps one element, apply2(col, v0, v1) the pair (col, col + 1) of a vector store
// (n even, col even, so col + 1 < n). A row may also hand its operand to a store that stages it in
// shared memory ahead of time (the TMA-store path): staged(col0) says whether the 16-byte pieces
// from col0 on can be copied from src(col), and apply2(v0, v1, bits) applies a pair read back.
// Everything is inlined into every path's store, so a path is written once and instantiated per
// epilogue; the plain one compiles to the code it replaced.
#pragma once
#include "gemm_common.cuh"

namespace gemm {

struct PlainEpilogue {
    struct Row {
        __device__ __forceinline__ float apply(uint32_t, float v) const { return v; }
        __device__ __forceinline__ void apply2(uint32_t, float&, float&) const {}
        __device__ __forceinline__ bool staged(uint32_t) const { return false; }
        __device__ __forceinline__ const void* src(uint32_t) const { return nullptr; }
        __device__ __forceinline__ void apply2(float&, float&, uint32_t) const {}
    };
    __device__ __forceinline__ Row row(uint64_t, uint32_t) const { return Row{}; }
};

// (acc + float(word_row[col])) * scale: fp32 add, fp32 multiply, no contraction, where word_row
// is over[row] when `over` is given and that entry is not null (an adapter's replacement row, n
// wide), else word[word_ids[row] * n ...]. A word id of kNoWord (and no replacement) writes the
// row as zeros (ngram_decode.cu's rows of bad input or padding).
struct WordEpilogue {
    const uint32_t* ids;
    const bf16* word;         // [vocab, n] row-major
    const bf16* const* over;  // [m] replacement rows (null entries: none), or null
    uint32_t n;
    float scale;
    bool pairs;  // word 4-byte aligned: with n and col even, a pair is one 4-byte load

    struct Row {
        const bf16* p;  // word row word_ids[row]; null for kNoWord: the row is written as zeros
        float scale;
        bool pairs;
        __device__ __forceinline__ float add(float v, bf16 x) const {
            return __fmul_rn(__fadd_rn(v, __bfloat162float(x)), scale);
        }
        __device__ __forceinline__ float apply(uint32_t col, float v) const {
            return p == nullptr ? 0.0f : add(v, __ldg(p + col));
        }
        __device__ __forceinline__ void apply2(uint32_t col, float& v0, float& v1) const {
            if (p == nullptr) {
                v0 = v1 = 0.0f;
            } else if (pairs) {
                const __nv_bfloat162 x = __ldg(reinterpret_cast<const __nv_bfloat162*>(p + col));
                v0 = add(v0, x.x);
                v1 = add(v1, x.y);
            } else {
                v0 = add(v0, __ldg(p + col));
                v1 = add(v1, __ldg(p + col + 1));
            }
        }
        // a zero row (p null) needs no operand; a word row is staged where its pieces are 16-byte
        // aligned (every row of a 16-byte aligned table with n % 8 == 0: the TMA-store path's)
        __device__ __forceinline__ bool staged(uint32_t col0) const {
            return p != nullptr && (reinterpret_cast<uintptr_t>(p + col0) & 15) == 0;
        }
        __device__ __forceinline__ const void* src(uint32_t col) const { return p + col; }
        __device__ __forceinline__ void apply2(float& v0, float& v1, uint32_t bits) const {
            __nv_bfloat162 x;
            memcpy(&x, &bits, 4);
            v0 = add(v0, x.x);
            v1 = add(v1, x.y);
        }
    };
    __device__ __forceinline__ Row row(uint64_t r, uint32_t m) const {
        const uint32_t id = r < m ? __ldg(ids + r) : 0u;  // word_ids (and over) have m entries
        const bf16* o = over != nullptr && r < m
            ? reinterpret_cast<const bf16*>(__ldg(reinterpret_cast<const unsigned long long*>(over) + r))
            : nullptr;
        if (o != nullptr) return Row{o, scale, pairs};
        return Row{id == kNoWord ? nullptr : word + static_cast<uint64_t>(id) * n, scale, pairs};
    }
};

// `pairs` needs every row 4-byte aligned: word's, and the replacement rows' (the caller's
// promise: OverlaySlots' rows are whole allocations, and with n even each row stays aligned).
__device__ __forceinline__ WordEpilogue word_epilogue(const uint32_t* ids, const bf16* word,
                                                      const bf16* const* over, uint32_t n,
                                                      float scale) {
    return WordEpilogue{ids, word, over, n, scale, (reinterpret_cast<uintptr_t>(word) & 3) == 0};
}

// c[row, col] and c[row, col + 1] (the second only while < n), through the row's epilogue `er`
// (ep.row(row, m)), rounded once.
template <class Row>
__device__ __forceinline__ void store_pair(bf16* c, uint64_t row, uint32_t col, uint32_t n,
                                           float v0, float v1, bool vec, const Row& er) {
    if (col >= n) return;
    bf16* p = c + row * n + col;
    if (vec) {  // n even and col even: col + 1 < n, and p is 4-byte aligned
        er.apply2(col, v0, v1);
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
    } else {
        p[0] = __float2bfloat16_rn(er.apply(col, v0));
        if (col + 1 < n) p[1] = __float2bfloat16_rn(er.apply(col + 1, v1));
    }
}

// The four accumulators of an m16n8 fragment that a thread holds, the layout of mma.sync's and
// wgmma's fp32 results: v[0], v[1] at (row, col), (row, col + 1) and v[2], v[3] at row + 8; e0
// and e8 are the epilogues of rows row and row + 8. Rows >= m are not stored.
template <class Row>
__device__ __forceinline__ void store_fragment(bf16* c, uint32_t row, uint32_t col, uint32_t m,
                                               uint32_t n, const float* v, bool vec, const Row& e0,
                                               const Row& e8) {
    if (row < m) store_pair(c, row, col, n, v[0], v[1], vec, e0);
    if (row + 8 < m) store_pair(c, row + 8, col, n, v[2], v[3], vec, e8);
}

}  // namespace gemm
