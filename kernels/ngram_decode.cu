// Device-resident n-gram decoding (layers/ngram_embed/decoder.py): the look-back windows come from
// a per-slot token history kept on the device, so a prefill or decode step needs nothing from the
// host but its launches and can be captured in the caller's CUDA graph.
//
// State, per slot s of max_seqs:
//   hist[s, 0:H]  the slot's last H = N - 1 + max_draft tokens, position q at hist[s, q % H];
//   state[s, 0]   pos: tokens the slot holds (the next token's position);
//   state[s, 1]   hi: the highest pos written since, so hist holds positions hi - H .. hi - 1.
// A rollback lowers pos by at most what keeps positions pos - (N-1) .. pos - 1 in the ring
// (hi - pos <= max_draft); the next write overwrites the dropped positions.
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
// sequence start does), and a bad sequence, fork or rollback leaves its slots untouched. Two
// sequences of one call on the same slot (or a fork whose destination is another pair's source
// or destination) race on that slot's history (in bounds, result unspecified).
#include "ngram_hash.cuh"
#include "gemm_small.cuh"

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
constexpr uint32_t kErrLaunch = 32;   // ngram_decode_step launched with a shape it cannot run
constexpr uint32_t kStepMaxRows = 8;  // ngram_decode_step: rows of one call (the small path's NT = 1)

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
// `first` is this thread's index in the team that runs it, `stride` the team's size.
__device__ void commit(const uint32_t* tokens, const uint32_t* cu, const uint32_t* slots,
                       uint32_t* hist, uint32_t* state, uint32_t* errors, uint32_t rows,
                       uint32_t num_seqs, uint32_t per_seq, uint32_t max_seqs, uint32_t hist_len,
                       uint32_t vocab, uint32_t first, uint32_t stride) {
    if (cu != nullptr && first == 0 && (__ldg(cu) != 0 || __ldg(cu + num_seqs) != rows))
        atomicOr(errors, kErrSeqlens);
    for (uint32_t s = first; s < num_seqs; s += stride) {
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
        const uint32_t pos = state[2 * slot];
        const uint32_t keep = min(len, hist_len);
        uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
        for (uint32_t e = 0; e < keep; ++e)
            h[(pos + len - keep + e) % hist_len] = clean(__ldg(tokens + sp.end - keep + e), vocab);
        state[2 * slot] = state[2 * slot + 1] = pos + len;
    }
}

// What every (row, table) pair of a gather call reads.
struct Call {
    const uint32_t* tokens;
    const uint32_t* cu;  // cu_seqlens, or null: per_seq rows each
    const uint32_t* slots;
    const uint32_t* hist;
    const uint32_t* state;
    const uint64_t* tables;
    const uint64_t* pows;
    uint32_t rows, num_seqs, per_seq, max_seqs, hist_len, vocab, num_tables, max_ngram, splits, td, eos;
};

// Row r's sequence, its rows, slot and token, and what the row may do.
struct RowInfo {
    uint32_t s;
    Span sp;
    uint32_t slot, token;
    RowCheck check;
};

__device__ __forceinline__ RowInfo row_info(const Call& g, uint32_t r) {
    const uint32_t s = seq_of(g.cu, g.per_seq, g.num_seqs, r);
    const Span sp = span_of(g.cu, g.per_seq, s);
    const uint32_t slot = __ldg(g.slots + s);
    const uint32_t token = __ldg(g.tokens + r);
    return RowInfo{s, sp, slot, token, check_row(sp, r, g.rows, slot, token, g.max_seqs, g.vocab)};
}

// A row's word pair: the flags it raises, its word id (kNoWord: the row is written as zeros) and
// its adapter's replacement word row (null: the base table's).
struct WordPick {
    uint32_t flags, word;
    const bf16* over;
};

__device__ __forceinline__ WordPick word_pick(const Adapters& ad, const RowInfo& x) {
    WordPick p{x.check.flags, x.check.skip ? kNoWord : x.token, nullptr};
    if (!x.check.skip && ad.index != nullptr) {
        const uint32_t a = __ldg(ad.index + x.s);
        if (a != kNoAdapter && a >= ad.num) {
            p.flags |= kErrAdapter;
            p.word = kNoWord;
        } else if (a != kNoAdapter) {
            p.over = ad.row_of(a, x.token);
        }
    }
    return p;
}

// Whether the look-back window and the history ring fit a warp (window_lane's case).
__device__ __forceinline__ bool short_window(const Call& g) {
    return g.max_ngram <= kWarp && g.hist_len <= kWarp;
}

// Row r's token d = lane positions back (kNoToken before the context start), for a row that is not
// skipped and a short_window call. The ring is read whole (lane e: entry e) beside pos, not after
// it, and picked with a shuffle: one dependent load fewer per step. Every lane of the warp.
__device__ __forceinline__ uint32_t window_lane(const Call& g, const RowInfo& x, uint32_t r,
                                                uint32_t lane) {
    const uint32_t at = r - x.sp.start;  // the row's position in this call's tokens
    const uint32_t* h = g.hist + static_cast<uint64_t>(x.slot) * g.hist_len;
    const uint32_t ring = lane < g.hist_len ? h[lane] : kNoToken;
    const uint32_t pos = g.state[2 * x.slot];
    const uint32_t here =
        lane <= at && lane < g.max_ngram ? clean(__ldg(g.tokens + r - lane), g.vocab) : kNoToken;
    const uint32_t back = lane - at;  // positions before this call (lane > at)
    const bool in_ring = lane > at && back <= pos;
    const uint32_t old = __shfl_sync(ngram::kFull, ring, in_ring ? (pos - back) % g.hist_len : 0);
    return lane <= at ? here : in_ring ? old : kNoToken;
}

// Row r's id in table c (descriptor t) for a row that is not skipped; `mine` is window_lane's
// token where short_window(g) (unused otherwise). Every lane of the warp.
__device__ __forceinline__ uint32_t table_id(const Call& g, const RowInfo& x, uint32_t r, uint32_t c,
                                             const ngram::Table& t, uint32_t mine, uint32_t lane) {
    const uint64_t* p = g.pows + static_cast<uint64_t>(c) * g.max_ngram;
    const uint32_t order = c / g.splits + 2;
    if (short_window(g))
        return ngram::hash_id([mine](uint32_t) { return mine; }, p, order, t.rows, g.eos, lane);
    const uint32_t at = r - x.sp.start;  // the row's position in this call's tokens
    const uint32_t* h = g.hist + static_cast<uint64_t>(x.slot) * g.hist_len;
    const uint32_t pos = g.state[2 * x.slot];
    const auto window = [=](uint32_t d) -> uint32_t {
        if (d <= at) return clean(__ldg(g.tokens + r - d), g.vocab);
        const uint32_t back = d - at;  // positions before this call
        return back > pos ? kNoToken : h[(pos - back) % g.hist_len];
    };
    return ngram::hash_id(window, p, order, t.rows, g.eos, lane);
}

// dst[0:td] = row r's row of table c (zeros for a skipped row): one warp, every lane.
__device__ __forceinline__ void table_row(const Call& g, const RowInfo& x, uint32_t r, uint32_t c,
                                          bf16* dst, uint32_t lane) {
    if (x.check.skip) {
        zero_row(dst, g.td, lane);
        return;
    }
    const ngram::Table t = ngram::load_table(g.tables, c);
    const uint32_t mine = short_window(g) ? window_lane(g, x, r, lane) : kNoToken;
    ngram::copy_table_row(t, table_id(g, x, r, c, t, mine, lane), dst, g.td, lane);
}

// Called by every thread of every block once its reads of the histories are done: the last
// block to get here appends the tokens to them (threadfence before the count, as CUDA's
// threadFenceReduction) and resets the count in ctrl[1] for the next launch.
__device__ __forceinline__ void commit_when_last(const Call& g, uint32_t* hist, uint32_t* state,
                                                 uint32_t* ctrl) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(ctrl + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    commit(g.tokens, g.cu, g.slots, hist, state, ctrl, g.rows, g.num_seqs, g.per_seq, g.max_seqs,
           g.hist_len, g.vocab, threadIdx.x, blockDim.x);
    if (threadIdx.x == 0) ctrl[1] = 0;
}

// The one-kernel step's stage of gemm::small_m_gemm (kSharedA): every row's T table rows into
// shared memory (row r at a + r * T * td) and its word row into word_rows[r] (block 0 raises the
// flags). Warp w takes row w % rows and every nq-th table from w / rows (nq: the warps on that
// row), so each warp walks the chain of dependent loads (slot, history, table rows) once, with up
// to four tables' rows prefetched together. Then thread 0 counts the block in ctrl[1]: `ticket`
// is the count before it (gridDim.x - 1: the last block to have read the histories).
struct StepGather {
    static constexpr bool kSharedA = true;
    static constexpr uint32_t kBatch = 4;  // tables whose rows are requested together
#ifndef NGRAM_STEP_PRE
#define NGRAM_STEP_PRE 0
#endif
    static constexpr uint32_t kPre = NGRAM_STEP_PRE;  // w stages requested before the gather
    const Call& g;
    const Adapters& ad;
    const bf16* word;
    uint32_t hidden;
    uint32_t* ctrl;
    const bf16** word_rows;
    uint32_t& ticket;

    __device__ __forceinline__ void operator()(uint32_t a_sh) const {
        pdl_wait();  // the tokens (and the histories) may come from the kernel before
        bf16* a = reinterpret_cast<bf16*>(gemm::smem_raw + (a_sh - gemm::smem_u32(gemm::smem_raw)));
        const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
        const uint32_t rows = g.rows, tables = g.num_tables, td = g.td;
        const uint32_t r = warp % rows, q = warp / rows, nq = (gemm::kWarps - r + rows - 1) / rows;
        bf16* dst = a + static_cast<uint64_t>(r) * tables * td;
        const RowInfo x = row_info(g, r);
        if (q == 0 && lane == 0) {
            const WordPick p = word_pick(ad, x);
            if (p.flags && blockIdx.x == 0) atomicOr(ctrl, p.flags);
            word_rows[r] = p.over != nullptr ? p.over
                           : p.word == kNoWord ? nullptr
                                               : word + static_cast<uint64_t>(p.word) * hidden;
        }
        if (x.check.skip) {
            for (uint32_t c = q; c < tables; c += nq) zero_row(dst + c * td, td, lane);
        } else {
            const uint32_t mine = short_window(g) ? window_lane(g, x, r, lane) : kNoToken;
            for (uint32_t c0 = q; c0 < tables; c0 += kBatch * nq) {
                uint32_t ids[kBatch];
#pragma unroll
                for (uint32_t j = 0; j < kBatch; ++j) {
                    const uint32_t c = c0 + j * nq;
                    if (c >= tables) break;
                    const ngram::Table t = ngram::load_table(g.tables, c);
                    ids[j] = table_id(g, x, r, c, t, mine, lane);
                    ngram::prefetch_table_row(t, ids[j], td, lane);
                }
#pragma unroll
                for (uint32_t j = 0; j < kBatch; ++j) {
                    const uint32_t c = c0 + j * nq;
                    if (c >= tables) break;
                    ngram::copy_table_row(ngram::load_table(g.tables, c), ids[j], dst + c * td, td, lane);
                }
            }
        }
        __syncthreads();  // a and word_rows complete; this block's reads of the histories done
        if (threadIdx.x == 0) {
            __threadfence();
            ticket = atomicAdd(ctrl + 1, 1u);
        }
    }
};

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
    const Call g{tokens, cu_seqlens, slots, hist, state, tables, pows, rows, num_seqs, per_seq,
                 max_seqs, hist_len, vocab, num_tables, max_ngram, splits, td, eos};
    const Adapters ad{adapters, adapter_maps, adapter_rows, adapter_counts, num_adapters, hidden};
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t pairs = static_cast<uint64_t>(rows) * (num_tables + 1);  // + the word pairs
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    uint64_t i = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    for (; i < pairs; i += warps) {  // warp-uniform: the hash's ballots see all 32 lanes
        // Table-major (i = c * rows + r): the warps in flight read one table at a time, which
        // keeps a host-memory table's pages within the GPU's TLB reach (2.3x faster at prefill).
        const uint32_t c = static_cast<uint32_t>(i / rows);
        const uint32_t r = static_cast<uint32_t>(i - static_cast<uint64_t>(c) * rows);
        const RowInfo x = row_info(g, r);
        if (c < num_tables) {
            table_row(g, x, r, c, out + (static_cast<uint64_t>(r) * num_tables + c) * td, lane);
        } else if (lane == 0) {  // the row's word pair: its flags, word id and replacement row
            const WordPick p = word_pick(ad, x);
            if (p.flags) atomicOr(ctrl, p.flags);
            word_ids[r] = p.word;
            if (word_over != nullptr) word_over[r] = p.over;
        }
    }
    commit_when_last(g, hist, state, ctrl);
}

// The whole decode call in one kernel, for rows <= kStepMaxRows (a step of up to eight tokens):
// out[r, :] = bf16((gathered row r @ proj^T + word row) * scale), the same bits as
// ngram_decode_gather followed by dense_gemm_bf16_word on the small path (gemm_small.cuh). Each
// block requests the first stages of its 32-column slice of proj [hidden, T*td], then gathers every
// row's T table rows into its shared memory and picks the word rows (StepGather: its own copy, so
// no block waits for another), then runs the small path's K loop reading a there. The last block
// to have read the histories appends the tokens after its own columns (warp 0). Launched with 256
// threads and small_smem_bytes(rows) + rows * T * td * 2 bytes of dynamic shared memory, td % 8 ==
// 0 (layers/ops/ngram_decode.py); any other launch writes nothing and flags kErrLaunch. May be a
// programmatic dependent of the kernel that writes the tokens: it waits for it before reading them.
extern "C" __global__ void __launch_bounds__(256, 1) ngram_decode_step(
    const uint32_t* tokens, const uint32_t* cu_seqlens, const uint32_t* slots, uint32_t* hist,
    uint32_t* state, const uint64_t* tables, const uint64_t* pows, uint32_t* ctrl, uint32_t rows,
    uint32_t num_seqs, uint32_t per_seq, uint32_t max_seqs, uint32_t hist_len, uint32_t vocab,
    uint32_t num_tables, uint32_t max_ngram, uint32_t splits, uint32_t td, uint32_t eos,
    const uint32_t* adapters, const int32_t* const* adapter_maps, const bf16* const* adapter_rows,
    const int32_t* adapter_counts, uint32_t num_adapters, uint32_t hidden, const bf16* proj,
    const bf16* word, bf16* out, float scale) {
    const uint32_t k = num_tables * td;
    if (!gemm::block_is_256() || rows == 0 || rows > kStepMaxRows || td % 8 != 0 ||
        gemm::dynamic_smem_bytes() < gemm::small_smem_bytes(rows) + 2ull * rows * k) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(ctrl, kErrLaunch);
        return;
    }
    const Call g{tokens, cu_seqlens, slots, hist, state, tables, pows, rows, num_seqs, per_seq,
                 max_seqs, hist_len, vocab, num_tables, max_ngram, splits, td, eos};
    const Adapters ad{adapters, adapter_maps, adapter_rows, adapter_counts, num_adapters, hidden};
    __shared__ const bf16* word_rows[kStepMaxRows];
    uint32_t ticket = 0;
    const StepGather gather{g, ad, word, hidden, ctrl, word_rows, ticket};
    const gemm::WordRowsEpilogue ep{word_rows, scale, (reinterpret_cast<uintptr_t>(word) & 3) == 0};
    gemm::small_m_gemm<1>(nullptr, proj, out, rows, hidden, k, ep, gather);
    if (threadIdx.x < kWarp && __shfl_sync(ngram::kFull, ticket, 0) == gridDim.x - 1) {
        __threadfence();
        commit(tokens, cu_seqlens, slots, hist, state, ctrl, rows, num_seqs, per_seq, max_seqs,
               hist_len, vocab, threadIdx.x, kWarp);
        if (threadIdx.x == 0) ctrl[1] = 0;  // ready for the next launch
    }
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
    const uint32_t pos = state[2 * slot];
    uint32_t* h = hist + static_cast<uint64_t>(slot) * hist_len;
    bool bad = false;
    for (uint32_t e = lane; e < keep; e += kWarp) {
        const uint32_t token = __ldg(tokens + sp.end - keep + e);
        bad |= token >= vocab;
        h[(pos + len - keep + e) % hist_len] = clean(token, vocab);
    }
    if (__any_sync(ngram::kFull, bad) && lane == 0) atomicOr(ctrl, kErrToken);
    __syncwarp();  // every lane has read pos
    if (lane == 0) state[2 * slot] = state[2 * slot + 1] = pos + len;
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
