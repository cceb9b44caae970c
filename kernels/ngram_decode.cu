// Device-resident n-gram decoding (layers/ngram_embed/decoder.py): the look-back windows come from
// a per-slot token history kept on the device, so a prefill or decode step needs nothing from the
// host but its launches and can be captured in the caller's CUDA graph.
//
// The histories (hist, state) and their rules: token_history.cuh; their seed, fork and rollback
// kernels: token_history.cu. Here a history entry is the token itself (TokenCode without a map).
//
// ngram_decode_gather: one warp per (row r, table c) pair, as ngram_fused.cu's ngram_gather, with
// the window read from this call's tokens (rows of the same sequence before r) and the history
// (positions before the call), plus one warp per row for its word row (c == T): the row's flags,
// its word id and, with adapters, the adapter's replacement row (OverlaySlots' tables). Then the
// last block to finish (a counter in ctrl[1], reset by that block) appends every sequence's
// tokens to its history: all other blocks have read the history by then, so one launch both
// reads and updates it.
//
// A slot of kPadSlot is a padded batch entry: its rows are written as zeros, no history is read
// or written and no flag is raised, in every kernel. Bad values only the device sees never make a
// kernel read or write outside its buffers: a token >= vocab, a slot >= max_seqs (not kPadSlot),
// cu_seqlens that are not 0 <= ... <= rows and non-decreasing or an adapter index >=
// num_adapters (not kNoAdapter) set a bit of ctrl[0] (atomicOr); the
// affected rows get zero gathered rows and the word id kNoWord (the GEMM epilogue then writes
// zeros), a bad token is kept in the history as kNoToken (it ends later tokens' look-back, as a
// sequence start does), and a bad sequence, fork or rollback leaves its slots untouched
// (cu_seqlens that go down: which rows are zeroed and which sequences append is unspecified). Two
// sequences of one call on the same slot (or a fork whose destination is another pair's source
// or destination) race on that slot's history (in bounds, result unspecified).
#include "ngram_hash.cuh"
#include "token_history.cuh"

namespace {

using history::kErrSeqlens;
using history::kNoToken;
using history::kPadSlot;
using history::RowCheck;
using history::Span;
using ngram::kWarp;
constexpr uint32_t kNoAdapter = 0xffffffffu;  // a sequence on the base word table (NO_ADAPTER)
constexpr uint32_t kErrAdapter = 16;  // an adapter index >= num_adapters (token_history.cuh: 1-8)

__device__ __forceinline__ void zero_row(bf16* dst, uint32_t td, uint32_t lane) {
    for (uint32_t j = lane; j < td; j += kWarp) dst[j] = __float2bfloat16_rn(0.0f);
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
    const history::TokenCode code{nullptr, nullptr, vocab, kNoToken};  // entries: the tokens
    const uint32_t lane = threadIdx.x % kWarp;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    const uint64_t first = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
    // Table-major pairs (i = c * rows + r, c == num_tables: the word pairs): the warps in flight
    // read one table at a time, which keeps a host-memory table's pages within the GPU's TLB
    // reach (for host tables the launcher gives each warp one pair: pair_launch in
    // layers/ops/ngram_fused.py). Warp-uniform: the hash's ballots see all 32 lanes.
    for (ngram::PairWalk pair(first, warps, rows); pair.c <= num_tables; pair.next()) {
        const uint32_t c = static_cast<uint32_t>(pair.c), r = pair.r;
        const uint32_t s = history::seq_of(cu_seqlens, per_seq, num_seqs, r);
        const Span sp = history::span_of(cu_seqlens, per_seq, s);
        const uint32_t slot = __ldg(slots + s);
        const uint32_t token = __ldg(tokens + r);
        const RowCheck check = history::check_row(sp, r, rows, slot, token, max_seqs, vocab);
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
            const uint32_t here = lane <= at && lane < max_ngram ? code.code(__ldg(tokens + r - lane), r - lane) : kNoToken;
            const uint32_t back = lane - at;  // positions before this call (lane > at)
            const bool in_ring = lane > at && back <= pos;
            const uint32_t old = __shfl_sync(ngram::kFull, ring, in_ring ? (pos - back) % hist_len : 0);
            const uint32_t mine = lane <= at ? here : in_ring ? old : kNoToken;
            id = ngram::hash_id([mine](uint32_t) { return mine; }, p, order, t.rows, eos, lane);
        } else {
            const uint32_t pos = state[2 * slot];
            const auto window = [=](uint32_t d) -> uint32_t {
                if (d <= at) return code.code(__ldg(tokens + r - d), r - d);
                const uint32_t back = d - at;  // positions before this call
                return back > pos ? kNoToken : h[(pos - back) % hist_len];
            };
            id = ngram::hash_id(window, p, order, t.rows, eos, lane);
        }
        ngram::copy_table_row(t, id, dst, td, lane);
    }

    // The last block to get here appends the tokens to the histories: every other block has
    // finished reading them.
    if (history::last_block(ctrl + 1))
        history::commit(tokens, code, cu_seqlens, slots, hist, state, ctrl, rows, num_seqs, per_seq,
                        max_seqs, hist_len);
}
