// LoRA token overlays: an adapter replaces some rows of the token embedding and of the LM head.
// A multi-adapter server keeps one served table and, per adapter slot, only the rows that
// differ; every token of a batch is routed to its sequence's slot. Launchers:
// layers/ops/token_overlay.py, which follows the seed tests/seeds/ops_token_overlay.rs argument
// for argument.
//
// - embed_rowdiff_bf16: at adapter build, which rows of the adapter's table differ from the
//   served one (one thread per row).
// - embed_overlay_routed_bf16: after the embed gather, copy each overridden token's
//   replacement row over its output row (one block per token row).
// - lmhead_overlay_routed_{bf16,f32}: after the LM head, recompute the logit of each overridden
//   id with the adapter's row (one warp per (row, override index)).
//
// Skip rules are the seed's, read literally; a null table entry means "no overlay for this
// slot". The routed kernels take two arguments past the seed's: num_slots, the length of the slot
// tables, and err, a word (may be null). With num_slots > 0 a slot index s >= num_slots (from a
// device seq_slot, which the host cannot see) skips its row and sets kOverlayBadSlot in *err;
// num_slots = 0 is the seed's contract (the caller guarantees every s < the tables' length).

#include "row_copy.cuh"

namespace {

constexpr uint32_t kOverlayBadSlot = 1;  // *err: a row's slot index was >= num_slots (row skipped)

// True (and *err flagged, by the caller's one thread) when slot s is past the tables.
__device__ __forceinline__ bool slot_outside(int32_t s, uint32_t num_slots) {
    return num_slots != 0 && uint32_t(s) >= num_slots;
}

// Exact bf16 -> f32 of the low / high half of a 32-bit word (element 2k is the low half).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// True when the element pair differs by more than thresh. Equal values (equal infinities,
// +0 / -0 included) differ by 0; a NaN on either side makes the difference NaN, and a NaN
// difference counts as "more than thresh" (a row holding a NaN is always flagged).
__device__ __forceinline__ bool elem_differs(float a, float b, float thresh) {
    const float d = (a == b) ? 0.0f : fabsf(__fsub_rn(a, b));
    return !(d <= thresh);
}

__device__ __forceinline__ bool word_differs(uint32_t a, uint32_t b, float thresh) {
    return elem_differs(bf16_lo(a), bf16_lo(b), thresh) | elem_differs(bf16_hi(a), bf16_hi(b), thresh);
}

}  // namespace

// flags[r] = (max_i |float(base[r,i]) - float(served[r,i])| > thresh) ? 1 : 0, with a NaN
// difference counted as greater (see elem_differs). base, served: [rows, h] bf16; flags: [rows].
// One thread per row, stopping at the first differing element; 16-byte loads when h % 8 == 0
// and both tables are 16-byte aligned (then every row is), bf16 loads otherwise.
extern "C" __global__ void embed_rowdiff_bf16(const bf16* base, const bf16* served, uint8_t* flags,
                                              uint32_t rows, uint32_t h, float thresh) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const size_t off = size_t(r) * h;
    bool differ = false;
    if ((h & 7u) == 0 && aligned16(base, served)) {
        const uint4* a = reinterpret_cast<const uint4*>(base + off);
        const uint4* b = reinterpret_cast<const uint4*>(served + off);
        const uint32_t nvec = h >> 3;
        for (uint32_t v = 0; v < nvec && !differ; ++v) {
            const uint4 x = __ldg(a + v);
            const uint4 y = __ldg(b + v);
            differ = word_differs(x.x, y.x, thresh) | word_differs(x.y, y.y, thresh) |
                     word_differs(x.z, y.z, thresh) | word_differs(x.w, y.w, thresh);
        }
    } else {
        const uint16_t* a = reinterpret_cast<const uint16_t*>(base + off);
        const uint16_t* b = reinterpret_cast<const uint16_t*>(served + off);
        for (uint32_t i = 0; i < h && !differ; ++i) {
            differ = elem_differs(bf16_bits(__ldg(a + i)), bf16_bits(__ldg(b + i)), thresh);
        }
    }
    flags[r] = differ ? 1 : 0;
}

// In place, after the embed gather: out[r, :] = rows_tab[s][slot, :] for each overridden token.
// One block per token row r (grid [num_tokens]); the block-uniform skip rules, in the seed's
// order: s = seq_slot ? seq_slot[r] : active; skip s < 0; skip a null slot_map_tab[s] (or a
// null rows_tab[s]); skip ids[r] >= vocab; slot = slot_map_tab[s][ids[r]]; skip slot < 0 or
// slot >= n_tab[s]. The copy is bit for bit (row_copy.cuh, the whole block): 16-byte vectors when
// h % 8 == 0 and both rows are 16-byte aligned, 2-byte elements otherwise.
extern "C" __global__ void embed_overlay_routed_bf16(const uint32_t* ids, const int32_t* seq_slot,
                                                     int32_t active,
                                                     const int32_t* const* slot_map_tab,
                                                     const bf16* const* rows_tab,
                                                     const int32_t* n_tab, bf16* out, uint32_t h,
                                                     uint32_t vocab, uint32_t num_slots,
                                                     uint32_t* err) {
    const uint32_t r = blockIdx.x;
    const int32_t s = seq_slot != nullptr ? seq_slot[r] : active;
    if (s < 0) return;
    if (slot_outside(s, num_slots)) {
        if (threadIdx.x == 0 && err != nullptr) atomicOr(err, kOverlayBadSlot);
        return;
    }
    const int32_t* map = slot_map_tab[s];
    const bf16* rows = rows_tab[s];
    if (map == nullptr || rows == nullptr) return;
    const uint32_t id = ids[r];
    if (id >= vocab) return;
    const int32_t slot = map[id];
    if (slot < 0 || slot >= n_tab[s]) return;

    const bf16* src = rows + size_t(slot) * h;
    bf16* dst = out + size_t(r) * h;
    row_copy::copy_bf16_row(src, dst, h, row_copy::bf16_vec(src, dst, h), row_copy::Block{});
}

namespace {

__device__ __forceinline__ void store_logit(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_logit(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// acc += x_k * w_k for the two bf16 of a word, low half first. A bf16 x bf16 product is exact
// in fp32, so the fma equals the separate multiply and add (one rounding per element).
__device__ __forceinline__ float dot_word(uint32_t x, uint32_t w, float acc) {
    acc = __fmaf_rn(bf16_lo(x), bf16_lo(w), acc);
    return __fmaf_rn(bf16_hi(x), bf16_hi(w), acc);
}

// logits[r, id] = dot(hidden[r, :], rows_tab[s][j, :]) with id = ids_tab[s][j]; one warp per
// (r = blockIdx.x, j = blockIdx.y), all skip rules warp-uniform. Summation order (the
// reference, lmhead_dot in layers/reference.py, reproduces it):
//   vector path (h % 8 == 0, both rows 16-byte aligned): lane l takes the 8-element chunks
//     c = l, l + 32, l + 64, ... in that order, adding the 8 products of a chunk in element
//     order into one fp32 accumulator;
//   scalar path: lane l adds the products of elements i = l, l + 32, ... in that order;
//   then a butterfly: for off = 16, 8, 4, 2, 1: acc = acc + shfl_xor(acc, off).
// The fp32 result is stored as is, or rounded once to bf16 (round to nearest even).
template <typename Out>
__device__ __forceinline__ void lmhead_overlay_routed(const bf16* hidden, const int32_t* seq_slot,
                                                      int32_t active, const bf16* const* rows_tab,
                                                      const int32_t* const* ids_tab,
                                                      const int32_t* n_tab, Out* logits,
                                                      uint32_t h, uint32_t vocab, uint32_t num_slots,
                                                      uint32_t* err) {
    const uint32_t r = blockIdx.x;
    const uint32_t j = blockIdx.y;
    const uint32_t lane = threadIdx.x;  // blockDim.x == 32 (launch bounds and launcher)
    const int32_t s = seq_slot != nullptr ? seq_slot[r] : active;
    if (s < 0) return;
    if (slot_outside(s, num_slots)) {
        if (lane == 0 && j == 0 && err != nullptr) atomicOr(err, kOverlayBadSlot);
        return;
    }
    const bf16* rows = rows_tab[s];
    const int32_t* ids = ids_tab[s];
    if (rows == nullptr || ids == nullptr) return;
    const int32_t n = n_tab[s];
    if (n <= 0 || j >= uint32_t(n)) return;
    const int32_t id = ids[j];
    if (id < 0 || uint32_t(id) >= vocab) return;

    const bf16* x = hidden + size_t(r) * h;
    const bf16* w = rows + size_t(j) * h;
    float acc = 0.0f;
    if ((h & 7u) == 0 && aligned16(x, w)) {
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const uint4* w4 = reinterpret_cast<const uint4*>(w);
        const uint32_t nvec = h >> 3;
        for (uint32_t c = lane; c < nvec; c += 32) {
            const uint4 a = __ldg(x4 + c);
            const uint4 b = __ldg(w4 + c);
            acc = dot_word(a.x, b.x, acc);
            acc = dot_word(a.y, b.y, acc);
            acc = dot_word(a.z, b.z, acc);
            acc = dot_word(a.w, b.w, acc);
        }
    } else {
        const uint16_t* x2 = reinterpret_cast<const uint16_t*>(x);
        const uint16_t* w2 = reinterpret_cast<const uint16_t*>(w);
        for (uint32_t i = lane; i < h; i += 32) {
            acc = __fmaf_rn(bf16_bits(__ldg(x2 + i)), bf16_bits(__ldg(w2 + i)), acc);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
    }
    if (lane == 0) store_logit(logits + size_t(r) * vocab + uint32_t(id), acc);
}

}  // namespace

// In place, after the LM head: recompute the overridden logit columns of [m, vocab] bf16
// logits. Grid [m, max_n_override], block 32; j >= n_tab[s] and ids outside 0..vocab-1 skip.
extern "C" __global__ void __launch_bounds__(32)
lmhead_overlay_routed_bf16(const bf16* hidden, const int32_t* seq_slot, int32_t active,
                           const bf16* const* rows_tab, const int32_t* const* ids_tab,
                           const int32_t* n_tab, bf16* logits, uint32_t h, uint32_t vocab,
                           uint32_t num_slots, uint32_t* err) {
    lmhead_overlay_routed<bf16>(hidden, seq_slot, active, rows_tab, ids_tab, n_tab, logits, h, vocab,
                                num_slots, err);
}

// Same as lmhead_overlay_routed_bf16 for [m, vocab] fp32 logits (no rounding of the fp32 sum).
extern "C" __global__ void __launch_bounds__(32)
lmhead_overlay_routed_f32(const bf16* hidden, const int32_t* seq_slot, int32_t active,
                          const bf16* const* rows_tab, const int32_t* const* ids_tab,
                          const int32_t* n_tab, float* logits, uint32_t h, uint32_t vocab,
                          uint32_t num_slots, uint32_t* err) {
    lmhead_overlay_routed<float>(hidden, seq_slot, active, rows_tab, ids_tab, n_tab, logits, h, vocab,
                                 num_slots, err);
}
