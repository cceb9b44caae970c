// Per-slot token histories on the device, shared by every decoder whose kernels hash a token's
// predecessors (ngram_decode.cu for the n-gram embedding, engram.cu for Engram) and by
// token_history.cu's seed, fork and rollback kernels (layers/ops/token_history.py plans them).
//
// State, per slot s of max_seqs:
//   hist[s, 0:H]  the slot's last H = N - 1 + max_draft entries, position q at hist[s, q % H];
//   state[s, 0]   pos: tokens the slot holds (the next token's position);
//   state[s, 1]   hi: the highest pos written since, so hist holds positions hi - H .. hi - 1.
// An entry is a token's code (TokenCode: the token itself, or its id in a map) or kNoToken: a
// token that takes no part in a look-back (a bad token; for Engram a non-text position). A
// rollback lowers pos by at most what keeps positions pos - (N-1) .. pos - 1 in the ring
// (hi - pos <= max_draft). A write of len tokens sets pos += len and hi = max(hi, pos): a write
// shorter than the rollback before it leaves rejected tokens in the ring above pos, over
// positions below hi - H, so hi must not come down with pos (a later rollback would read them).
//
// A slot of kPadSlot is a padded batch entry: no history is read or written and no flag raised.
// Bad values only the device sees never make a kernel read or write outside its buffers: a token
// >= vocab, a slot >= max_seqs (not kPadSlot), cu_seqlens that are not 0 <= ... <= rows and
// non-decreasing, a rollback deeper than the history set a bit of the error word (atomicOr); a
// bad token is kept as kNoToken (it ends later tokens' look-back, as a sequence start does), a
// bad sequence, fork or rollback leaves its slots untouched.
#pragma once
#include "common.cuh"

namespace history {

constexpr uint32_t kWarp = 32;
constexpr uint32_t kNoToken = 0xffffffffu;    // an entry no look-back reads past
constexpr uint32_t kPadSlot = 0xffffffffu;    // a padded batch entry (layers: PAD_SLOT)
constexpr uint32_t kErrToken = 1;     // a token >= vocab
constexpr uint32_t kErrSlot = 2;      // a slot >= max_seqs
constexpr uint32_t kErrSeqlens = 4;   // cu_seqlens not a partition of 0..rows
constexpr uint32_t kErrRollback = 8;  // a rollback deeper than the history holds

// What a history holds for a call's token t at row r: kNoToken for a token >= vocab, or where
// `text` (u8 per row) is given and 0, or (no `text`) for the token `dead`; otherwise map[t], or t
// itself without a map. The n-gram embedding passes neither map nor text (dead = kNoToken).
struct TokenCode {
    const int32_t* map;
    const uint8_t* text;
    uint32_t vocab, dead;

    __device__ __forceinline__ bool is_text(uint32_t t, uint32_t r) const {
        return text != nullptr ? __ldg(text + r) != 0 : t != dead;
    }
    __device__ __forceinline__ uint32_t code(uint32_t t, uint32_t r) const {
        if (t >= vocab || !is_text(t, r)) return kNoToken;
        return map != nullptr ? static_cast<uint32_t>(__ldg(map + t)) : t;
    }
};

// Rows [start, end) of sequence s: uniform `per_seq` rows each when cu_seqlens is null.
struct Span {
    uint32_t start, end;
    __device__ __forceinline__ bool sane(uint32_t rows) const { return start <= end && end <= rows; }
};

__device__ __forceinline__ Span span_of(const uint32_t* cu, uint32_t per_seq, uint32_t s) {
    if (cu == nullptr) return Span{s * per_seq, (s + 1) * per_seq};
    return Span{__ldg(cu + s), __ldg(cu + s + 1)};
}

// The sequence holding row r: the last s < num_seqs with cu[s] <= r (binary search; bad
// cu_seqlens give some s in range, which the caller's bounds check then rejects).
__device__ __forceinline__ uint32_t seq_of(const uint32_t* cu, uint32_t per_seq, uint32_t num_seqs,
                                           uint32_t r) {
    if (cu == nullptr) return r / per_seq;
    uint32_t lo = 0, hi = num_seqs;
    while (hi - lo > 1) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (__ldg(cu + mid) <= r) lo = mid; else hi = mid;
    }
    return lo;
}

// What row r of sequence s (rows sp) may do: `flags` to raise, and `skip` (flagged, or padding):
// its output is zeros and it reads no history.
struct RowCheck {
    uint32_t flags;
    bool skip;
};

__device__ __forceinline__ RowCheck check_row(const Span& sp, uint32_t r, uint32_t rows,
                                              uint32_t slot, uint32_t token, uint32_t max_seqs,
                                              uint32_t vocab) {
    uint32_t flags = sp.sane(rows) && sp.start <= r && r < sp.end ? 0u : kErrSeqlens;
    if (slot == kPadSlot) return RowCheck{flags, true};
    if (slot >= max_seqs) flags |= kErrSlot;
    if (token >= vocab) flags |= kErrToken;
    return RowCheck{flags, flags != 0};
}

// The entry d positions before row r (d >= 1 reaches into the history): this call's row r - d
// when d <= at (r's position in its sequence's rows), else the slot's history, kNoToken before
// the slot's first position. `h` is the slot's ring, `pos` its state[0] when the call began.
__device__ __forceinline__ uint32_t entry_back(const uint32_t* tokens, const TokenCode& code,
                                               uint32_t r, uint32_t at, uint32_t d,
                                               const uint32_t* h, uint32_t pos, uint32_t hist_len) {
    if (d <= at) return code.code(__ldg(tokens + r - d), r - d);
    const uint32_t back = d - at;  // positions before this call
    return back > pos ? kNoToken : h[(pos - back) % hist_len];
}

// Append sequence s's tokens (rows sp of `tokens`) to slot `slot`'s history: its last
// min(len, H) entries are written (only those are read), pos and hi move on. `lane` of `lanes`
// (a warp, or one thread) writes every lanes-th entry; true where one it read was >= vocab.
__device__ __forceinline__ bool append(const uint32_t* tokens, const TokenCode& code, const Span& sp,
                                       uint32_t slot, uint32_t* hist, uint32_t* state,
                                       uint32_t hist_len, uint32_t lane, uint32_t lanes) {
    const uint32_t len = sp.end - sp.start;
    const uint32_t pos = state[2 * slot], hi = state[2 * slot + 1];
    const uint32_t keep = min(len, hist_len);
    uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
    bool bad = false;
    for (uint32_t e = lane; e < keep; e += lanes) {
        const uint32_t r = sp.end - keep + e;
        const uint32_t t = __ldg(tokens + r);
        bad |= t >= code.vocab;
        h[(pos + len - keep + e) % hist_len] = code.code(t, r);
    }
    if (lanes > 1) __syncwarp();  // every lane has read pos
    if (lane == 0) {
        state[2 * slot] = pos + len;
        state[2 * slot + 1] = max(hi, pos + len);
    }
    return bad;
}

// Append every sequence's tokens to its slot's history (run by one block, after every read):
// a thread per sequence, so a batch of up to blockDim.x sequences costs one chain of loads.
__device__ void commit(const uint32_t* tokens, const TokenCode& code, const uint32_t* cu,
                       const uint32_t* slots, uint32_t* hist, uint32_t* state, uint32_t* errors,
                       uint32_t rows, uint32_t num_seqs, uint32_t per_seq, uint32_t max_seqs,
                       uint32_t hist_len) {
    if (cu != nullptr && threadIdx.x == 0 && (__ldg(cu) != 0 || __ldg(cu + num_seqs) != rows))
        atomicOr(errors, kErrSeqlens);
    for (uint32_t s = threadIdx.x; s < num_seqs; s += blockDim.x) {
        const Span sp = span_of(cu, per_seq, s);
        const uint32_t slot = __ldg(slots + s);
        if (!sp.sane(rows)) {
            atomicOr(errors, kErrSeqlens);
            continue;
        }
        if (slot >= max_seqs) {  // padding; a bad slot (an empty sequence has no row to flag it)
            if (slot != kPadSlot) atomicOr(errors, kErrSlot);
            continue;
        }
        append(tokens, code, sp, slot, hist, state, hist_len, 0, 1);
    }
}

// True in the one block that gets here last (every thread of the block calls it): all other
// blocks have finished their reads by then (threadfence before the count, as CUDA's
// threadFenceReduction). `counter` must be 0 before the launch; the last block resets it.
__device__ __forceinline__ bool last_block(uint32_t* counter) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (read above, by all)
    }
    return last;
}

}  // namespace history
