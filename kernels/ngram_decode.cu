// Device-resident n-gram decoding (layers/ngram_embed/decoder.py): the look-back windows come from
// a per-slot token history kept on the device, so a prefill or decode step needs nothing from the
// host but its launches and can be captured in the caller's CUDA graph.
//
// State, per slot s of max_seqs:
//   hist[s, 0:H]  the slot's last H = N - 1 + max_draft tokens, position q at hist[s, q % H];
//   state[s, 0]   pos: tokens the slot holds (the next token's position);
//   state[s, 1]   hi: the highest pos written since, so hist holds positions hi - H .. hi - 1.
// A rollback lowers pos by at most what keeps positions pos - (N-1) .. pos - 1 in the ring
// (hi - pos <= max_draft). A write of len tokens sets pos += len and hi = max(hi, pos): a write
// shorter than the rollback before it leaves rejected tokens in the ring above pos, over
// positions below hi - H, so hi must not come down with pos (a later rollback would read them).
//
// ngram_decode_gather: one warp per (row r, table c) pair, as ngram_fused.cu's ngram_gather, with
// the window read from this call's tokens (rows of the same sequence before r) and the history
// (positions before the call), plus one warp per row for its word row (c == T): the row's flags,
// its word id and, with adapters, the adapter's replacement row (OverlaySlots' tables). Then the
// last block to finish (a counter in ctrl[1], reset by that block) appends every sequence's
// tokens to its history: all other blocks have read the history by then, so one launch both
// reads and updates it. ngram_decode_seed appends tokens without embedding them (a prefix-cache
// hit), ngram_decode_fork copies slots (parallel samples), ngram_decode_rollback drops drafts.
//
// A slot of kPadSlot is a padded batch entry: its rows are written as zeros, no history is read
// or written and no flag is raised, in every kernel. Bad values only the device sees never make a
// kernel read or write outside its buffers: a token >= vocab, a slot >= max_seqs (not kPadSlot),
// cu_seqlens that are not 0 <= ... <= rows and non-decreasing, a rollback deeper than the history
// or an adapter index >= num_adapters (not kNoAdapter) set a bit of ctrl[0] (atomicOr); the
// affected rows get zero gathered rows and the word id kNoWord (the GEMM epilogue then writes
// zeros), a bad token is kept in the history as kNoToken (it ends later tokens' look-back, as a
// sequence start does), and a bad sequence, fork or rollback leaves its slots untouched
// (cu_seqlens that go down: which rows are zeroed and which sequences append is unspecified). Two
// sequences of one call on the same slot (or a fork whose destination is another pair's source
// or destination) race on that slot's history (in bounds, result unspecified).
#include "ngram_hash.cuh"

namespace {

using ngram::kNoToken;
using ngram::kWarp;
constexpr uint32_t kPadSlot = 0xffffffffu;    // a padded batch entry (layers: PAD_SLOT)
constexpr uint32_t kNoAdapter = 0xffffffffu;  // a sequence on the base word table (NO_ADAPTER)
constexpr uint32_t kErrToken = 1;     // a token >= vocab
constexpr uint32_t kErrSlot = 2;      // a slot >= max_seqs
constexpr uint32_t kErrSeqlens = 4;   // cu_seqlens not a partition of 0..rows
constexpr uint32_t kErrRollback = 8;  // a rollback deeper than the history holds
constexpr uint32_t kErrAdapter = 16;  // an adapter index >= num_adapters

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

__device__ __forceinline__ uint32_t clean(uint32_t token, uint32_t vocab) {
    return token < vocab ? token : kNoToken;
}

__device__ __forceinline__ void zero_row(bf16* dst, uint32_t td, uint32_t lane) {
    for (uint32_t j = lane; j < td; j += kWarp) dst[j] = __float2bfloat16_rn(0.0f);
}

// What row r of sequence s (rows sp) may do: `flags` to raise, and `skip` (flagged, or padding):
// its output row is zeros and it reads no history.
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

// OverlaySlots' embedding tables (layers/overlay/slots.py), per adapter slot: the id -> row map
// (int32[vocab], -1: not overridden), the replacement rows [n, hidden], the count n.
struct Adapters {
    const uint32_t* index;  // [num_seqs] each sequence's adapter slot, or null: none at all
    const int32_t* const* maps;
    const bf16* const* rows;
    const int32_t* counts;
    uint32_t num, hidden;

    // The replacement word row of `token` (< vocab) in adapter slot a (< num), or null.
    __device__ __forceinline__ const bf16* row_of(uint32_t a, uint32_t token) const {
        const int32_t* map = maps[a];
        const bf16* base = rows[a];
        if (map == nullptr || base == nullptr) return nullptr;
        const int32_t j = map[token];
        return j >= 0 && j < counts[a] ? base + static_cast<uint64_t>(j) * hidden : nullptr;
    }
};

// Append every sequence's tokens to its slot's history (run by one block, after every read):
// a thread per sequence, so a batch of up to blockDim.x sequences costs one chain of loads.
__device__ void commit(const uint32_t* tokens, const uint32_t* cu, const uint32_t* slots,
                       uint32_t* hist, uint32_t* state, uint32_t* errors, uint32_t rows,
                       uint32_t num_seqs, uint32_t per_seq, uint32_t max_seqs, uint32_t hist_len,
                       uint32_t vocab) {
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
        const uint32_t len = sp.end - sp.start;
        const uint32_t pos = state[2 * slot], hi = state[2 * slot + 1];
        const uint32_t keep = min(len, hist_len);
        uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
        for (uint32_t e = 0; e < keep; ++e)
            h[(pos + len - keep + e) % hist_len] = clean(__ldg(tokens + sp.end - keep + e), vocab);
        state[2 * slot] = pos + len;
        state[2 * slot + 1] = max(hi, pos + len);
    }
}

}  // namespace

// out[r, c*td:(c+1)*td] = row id_c(r) of table c (r < rows), word_ids[r] = tokens[r] (kNoWord for
// a bad or padded row) and, when adapters are given, word_over[r] = the row's replacement word row
// (null: the base table's); then every sequence's tokens appended to its slot's history.
extern "C" __global__ void ngram_decode_gather(
    const uint32_t* tokens, const uint32_t* cu_seqlens, const uint32_t* slots, uint32_t* hist,
    uint32_t* state, const uint64_t* tables, const uint64_t* pows, bf16* out, uint32_t* word_ids,
    uint32_t* ctrl, uint32_t rows, uint32_t num_seqs, uint32_t per_seq, uint32_t max_seqs,
    uint32_t hist_len, uint32_t vocab, uint32_t num_tables, uint32_t max_ngram, uint32_t splits,
    uint32_t td, uint32_t eos, const uint32_t* adapters, const int32_t* const* adapter_maps,
    const bf16* const* adapter_rows, const int32_t* adapter_counts, uint32_t num_adapters,
    uint32_t hidden, const bf16** word_over) {
    pdl_launch_dependents();  // the GEMM may start streaming its weights (it waits for our rows)
    const Adapters ad{adapters, adapter_maps, adapter_rows, adapter_counts, num_adapters, hidden};
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    const uint64_t first = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    // Table-major pairs (i = c * rows + r, c == num_tables: the word pairs): the warps in flight
    // read one table at a time, which keeps a host-memory table's pages within the GPU's TLB
    // reach (for host tables the launcher gives each warp one pair: pair_launch in
    // layers/ops/ngram_fused.py). Warp-uniform: the hash's ballots see all 32 lanes.
    for (ngram::PairWalk pair(first, warps, rows); pair.c <= num_tables; pair.next()) {
        const uint32_t c = static_cast<uint32_t>(pair.c), r = pair.r;
        const uint32_t s = seq_of(cu_seqlens, per_seq, num_seqs, r);
        const Span sp = span_of(cu_seqlens, per_seq, s);
        const uint32_t slot = __ldg(slots + s);
        const uint32_t token = __ldg(tokens + r);
        const RowCheck check = check_row(sp, r, rows, slot, token, max_seqs, vocab);
        if (c == num_tables) {  // the row's word pair: its flags, word id and replacement row
            if (lane == 0) {
                uint32_t flags = check.flags, word = check.skip ? kNoWord : token;
                const bf16* over = nullptr;
                if (!check.skip && ad.index != nullptr) {
                    const uint32_t a = __ldg(ad.index + s);
                    if (a != kNoAdapter && a >= ad.num) {
                        flags |= kErrAdapter;
                        word = kNoWord;
                    } else if (a != kNoAdapter) {
                        over = ad.row_of(a, token);
                    }
                }
                if (flags) atomicOr(ctrl, flags);
                word_ids[r] = word;
                if (word_over != nullptr) word_over[r] = over;
            }
            continue;
        }
        bf16* dst = out + (static_cast<uint64_t>(r) * num_tables + c) * td;
        if (check.skip) {
            zero_row(dst, td, lane);
            continue;
        }
        if (ad.index != nullptr) {  // a bad adapter index (its word pair flags it): rows zeroed too,
            const uint32_t a = __ldg(ad.index + s);  // for a rank's epilogue, which never sees kNoWord
            if (a != kNoAdapter && a >= ad.num) {
                zero_row(dst, td, lane);
                continue;
            }
        }
        const uint32_t at = r - sp.start;  // the row's position in this call's tokens
        const uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
        const ngram::Table t = ngram::load_table(tables, c);
        const uint64_t* p = pows + static_cast<uint64_t>(c) * max_ngram;
        const uint32_t order = c / splits + 2;
        uint32_t id;
        if (max_ngram <= kWarp && hist_len <= kWarp) {
            // Lane d holds token d back. The ring is read whole (lane e: entry e) beside pos,
            // not after it, and picked with a shuffle: one dependent load fewer per step.
            const uint32_t ring = lane < hist_len ? h[lane] : kNoToken;
            const uint32_t pos = state[2 * slot];
            const uint32_t here = lane <= at && lane < max_ngram ? clean(__ldg(tokens + r - lane), vocab) : kNoToken;
            const uint32_t back = lane - at;  // positions before this call (lane > at)
            const bool in_ring = lane > at && back <= pos;
            const uint32_t old = __shfl_sync(ngram::kFull, ring, in_ring ? (pos - back) % hist_len : 0);
            const uint32_t mine = lane <= at ? here : in_ring ? old : kNoToken;
            id = ngram::hash_id([mine](uint32_t) { return mine; }, p, order, t.rows, eos, lane);
        } else {
            const uint32_t pos = state[2 * slot];
            const auto window = [=](uint32_t d) -> uint32_t {
                if (d <= at) return clean(__ldg(tokens + r - d), vocab);
                const uint32_t back = d - at;  // positions before this call
                return back > pos ? kNoToken : h[(pos - back) % hist_len];
            };
            id = ngram::hash_id(window, p, order, t.rows, eos, lane);
        }
        ngram::copy_table_row(t, id, dst, td, lane);
    }

    // The last block to get here appends the tokens to the histories: every other block has
    // finished reading them (threadfence before the count, as CUDA's threadFenceReduction).
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ctrl + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    commit(tokens, cu_seqlens, slots, hist, state, ctrl, rows, num_seqs, per_seq, max_seqs,
           hist_len, vocab);
    if (threadIdx.x == 0) ctrl[1] = 0;  // ready for the next launch
}

// Append sequence s's tokens (tokens[cu_seqlens[s]:cu_seqlens[s+1]]) to slot slots[s]'s history
// without embedding them: a prefix-cache hit. One warp per sequence; only the last H tokens of a
// sequence are read (and checked), so the cost grows with the sequences, not with D or the tokens.
extern "C" __global__ void ngram_decode_seed(const uint32_t* tokens, const uint32_t* cu_seqlens,
                                             const uint32_t* slots, uint32_t* hist,
                                             uint32_t* state, uint32_t* ctrl, uint32_t rows,
                                             uint32_t num_seqs, uint32_t max_seqs,
                                             uint32_t hist_len, uint32_t vocab) {
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t s = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    if (s == 0 && lane == 0 && (__ldg(cu_seqlens) != 0 || __ldg(cu_seqlens + num_seqs) != rows))
        atomicOr(ctrl, kErrSeqlens);
    if (s >= num_seqs) return;  // warp-uniform from here on: s and slot are the warp's
    const Span sp = span_of(cu_seqlens, 0, static_cast<uint32_t>(s));
    const uint32_t slot = __ldg(slots + s);
    if (!sp.sane(rows) || (slot >= max_seqs && slot != kPadSlot)) {
        if (lane == 0) atomicOr(ctrl, sp.sane(rows) ? kErrSlot : kErrSeqlens);
        return;
    }
    if (slot == kPadSlot) return;
    const uint32_t len = sp.end - sp.start;
    const uint32_t keep = min(len, hist_len);
    const uint32_t pos = state[2 * slot], hi = state[2 * slot + 1];
    uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
    bool bad = false;
    for (uint32_t e = lane; e < keep; e += kWarp) {
        const uint32_t token = __ldg(tokens + sp.end - keep + e);
        bad |= token >= vocab;
        h[(pos + len - keep + e) % hist_len] = clean(token, vocab);
    }
    if (__any_sync(ngram::kFull, bad) && lane == 0) atomicOr(ctrl, kErrToken);
    __syncwarp();  // every lane has read pos
    if (lane == 0) {
        state[2 * slot] = pos + len;
        state[2 * slot + 1] = max(hi, pos + len);
    }
}

// Slot dst_slots[p] becomes a copy of slot src_slots[p] (history and position), p < num: one warp
// per pair. A padded pair is skipped; a bad slot is flagged and its pair skipped.
extern "C" __global__ void ngram_decode_fork(const uint32_t* src_slots, const uint32_t* dst_slots,
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
extern "C" __global__ void ngram_decode_rollback(const uint32_t* slots, const uint32_t* counts,
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
