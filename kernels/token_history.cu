// The history-only kernels of every decoder (token_history.cuh: the state and its rules), planned
// by layers/ops/token_history.py: a prefix-cache hit's seed, forks and rollbacks. The decoders'
// own gathers (ngram_decode.cu, engram.cu) read the histories and append their calls' tokens.
#include "token_history.cuh"

using history::kErrRollback;
using history::kErrSeqlens;
using history::kErrSlot;
using history::kErrToken;
using history::kPadSlot;
using history::kWarp;

// Append sequence s's tokens (tokens[cu_seqlens[s]:cu_seqlens[s+1]]) to slot slots[s]'s history
// without embedding them: a prefix-cache hit. One warp per sequence; only the last H tokens of a
// sequence are read (and checked), so the cost grows with the sequences, not with the tokens.
// Their codes as the decoder's gather writes them (map, text, dead: TokenCode).
extern "C" __global__ void token_history_seed(const uint32_t* tokens, const uint32_t* cu_seqlens,
                                              const uint32_t* slots, const int32_t* map,
                                              const uint8_t* text, uint32_t* hist, uint32_t* state,
                                              uint32_t* ctrl, uint32_t rows, uint32_t num_seqs,
                                              uint32_t max_seqs, uint32_t hist_len, uint32_t vocab,
                                              uint32_t dead) {
    const history::TokenCode code{map, text, vocab, dead};
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t s = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    if (s == 0 && lane == 0 && (__ldg(cu_seqlens) != 0 || __ldg(cu_seqlens + num_seqs) != rows))
        atomicOr(ctrl, kErrSeqlens);
    if (s >= num_seqs) return;  // warp-uniform from here on: s and slot are the warp's
    const history::Span sp = history::span_of(cu_seqlens, 0, static_cast<uint32_t>(s));
    const uint32_t slot = __ldg(slots + s);
    if (!sp.sane(rows) || (slot >= max_seqs && slot != kPadSlot)) {
        if (lane == 0) atomicOr(ctrl, sp.sane(rows) ? kErrSlot : kErrSeqlens);
        return;
    }
    if (slot == kPadSlot) return;
    const bool bad = history::append(tokens, code, sp, slot, hist, state, hist_len, lane, kWarp);
    if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(ctrl, kErrToken);
}

// Slot dst_slots[p] becomes a copy of slot src_slots[p] (history and position), p < num: one warp
// per pair. A padded pair is skipped; a bad slot is flagged and its pair skipped.
extern "C" __global__ void token_history_fork(const uint32_t* src_slots, const uint32_t* dst_slots,
                                              uint32_t* hist, uint32_t* state, uint32_t* ctrl,
                                              uint32_t num, uint32_t max_seqs, uint32_t hist_len) {
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t p = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    if (p >= num) return;
    const uint32_t src = __ldg(src_slots + p), dst = __ldg(dst_slots + p);
    if (src == kPadSlot || dst == kPadSlot) return;
    if (src >= max_seqs || dst >= max_seqs) {
        if (lane == 0) atomicOr(ctrl, kErrSlot);
        return;
    }
    if (src == dst) return;
    const uint32_t* from = hist + static_cast<uint64_t>(src) * hist_len;
    uint32_t* to = hist + static_cast<uint64_t>(dst) * hist_len;
    for (uint32_t e = lane; e < hist_len; e += kWarp) to[e] = from[e];
    if (lane == 0) {
        state[2 * dst] = state[2 * src];
        state[2 * dst + 1] = state[2 * src + 1];
    }
}

// Drop the last counts[s] tokens of slots[s]'s history (speculative tokens rejected), s < num_seqs.
extern "C" __global__ void token_history_rollback(const uint32_t* slots, const uint32_t* counts,
                                                  uint32_t* state, uint32_t* ctrl,
                                                  uint32_t num_seqs, uint32_t max_seqs,
                                                  uint32_t max_draft) {
    const uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= num_seqs) return;
    const uint32_t slot = __ldg(slots + s);
    if (slot == kPadSlot) return;
    if (slot >= max_seqs) {
        atomicOr(ctrl, kErrSlot);
        return;
    }
    const uint32_t count = __ldg(counts + s);
    const uint32_t pos = state[2 * slot], hi = state[2 * slot + 1];
    const uint32_t room = min(pos, max_draft - (hi - pos));  // hi - pos <= max_draft always
    if (count > room) {
        atomicOr(ctrl, kErrRollback);
        return;
    }
    state[2 * slot] = pos - count;
}
