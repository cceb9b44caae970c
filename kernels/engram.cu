// Engram (DeepSeek-V4.1, docs/ENGRAM.md), planned by layers/ops/engram.py for layers/engram's runner.
//
// engram_lookup: for every row r of a call (ragged sequences over slots, as ngram_decode.cu) and
// every Engram layer l and hash column j, the row id from the token's compressed look-back, then
// that table row dequantised into emb[l, r, j*W:(j+1)*W] (bf16), then every sequence's tokens
// appended to its slot's history (token_history.cuh; an entry is the token's compressed id,
// kNoToken for a non-text position or a bad token). One warp per (l, j, r) item, items in
// (l, j)-major order, so the warps in flight read one prime bucket of one table at a time.
//
// The hash (layers/engram/hashing.py is its numpy twin): t[k] for k = 0..N-1 is the entry k
// positions back (k = 0: the token itself); from the first k whose entry is kNoToken or before
// the slot's first position on, t[k] = pad (blocked is sticky). r = t[0] * M[0]; for order
// n = 2..N, r ^= t[n-1] * M[n-1] (u64: no overflow, the multipliers are bounded so), and column
// j = (n - 2) * heads + h takes row r % P[j] + OFF[j].
//
// A table row is stored packed: W fp8 e4m3 bytes, then W/32 e8m0 scale bytes (2^(byte - 127)),
// padded to `stride` bytes (a multiple of 8). A table descriptor is 4 u64: the rows' address
// (device memory, or pinned host memory mapped into the device's address space), the first row
// this rank holds, how many, flags (unused: 0); a row outside [lo, lo + count) is another rank's
// and is written as zeros (tensor parallelism: a bf16 all-reduce brings it).
//
// Each value is bf16(f32(e4m3) * 2^(byte - 127)), then requantised as the model's fp8 linear
// quantises its input, per 32 columns: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(x / s),
// x' = q * s. For rows of this form that is the identity unless the block's amax < 1e-4 (then
// s = 2^-22 and small values round): emb holds the GEMM's exact operand.
//
// text_out[r] = 1 when row r is a text position that was hashed; 0 (a non-text position, padding,
// or a bad row): its emb rows are zeros and the gate leaves its residual as it is. A slot of
// kPadSlot reads and writes no history; bad values only the device sees set a bit of ctrl[0]
// (token_history.cuh). N <= 32 (lane k fetches the entry k back).
//
// engram_row_ids + engram_staged_rows: the same lookup in two halves, for a host table read by
// the host's threads (layers/engram/host_staging.py): the first hashes and writes each item's row
// to ids (the tables are not read; text flags, error bits and the history update as above), the
// host gathers those rows into pinned staging, the second dequantises the staged rows into emb, a
// range of rows at a time. emb gets the bits engram_lookup writes.
//
// engram_gate: one block per (token t, copy c) of the residual x [T, hc, D] (bf16, in place):
// key = kv[t, c*D:(c+1)*D], value = kv[t, hc*D:(hc+1)*D], in f32: dot = sum(x * q[c] * k[c] *
// key) * rsqrt(mean(x^2) + eps) * rsqrt(mean(key^2) + eps) * rsqrt(D); gate =
// sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)); x = bf16(x + gate * value). Rows with
// text[t] == 0 are not written.
#include "token_history.cuh"

namespace {

using history::kNoToken;
using history::kPadSlot;
using history::kWarp;
constexpr uint32_t kFull = 0xffffffffu;

struct Table {
    uint64_t data, lo, count, flags;
};

__device__ __forceinline__ Table load_table(const uint64_t* tables, uint32_t l) {
    const uint64_t* t = tables + 4 * static_cast<uint64_t>(l);
    return Table{__ldg(t), __ldg(t + 1), __ldg(t + 2), __ldg(t + 3)};
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// x' of one value (module comment): requantised only in a block whose amax < 1e-4.
__device__ __forceinline__ float requant(float v, bool tiny) {
    if (!tiny) return v;
    constexpr float kUp = 4194304.0f, kDown = 1.0f / 4194304.0f;  // 2^22, 2^-22: s for amax < 1e-4
    const __nv_fp8_e4m3 q(v * kUp);  // round to nearest even, satfinite (|v * 2^22| < 448 here)
    return static_cast<float>(q) * kDown;
}

// The row's 8 values at byte 8*i (i < W/8) dequantised, requantised and written as bf16 to
// dst[8*i:8*i+8]; every lane of the warp calls it (the block's amax is a 4-lane shuffle).
__device__ __forceinline__ void copy_chunk(const uint8_t* row, uint32_t width, uint32_t i,
                                           bool active, bf16* dst) {
    float v[8];
    float amax = 0.0f;
    if (active) {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(row) + i);
        const float s = e8m0(__ldg(row + width + i / 4));  // 32 columns a scale: 4 lanes
        const uint32_t w[2] = {q.x, q.y};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            __nv_fp8_e4m3 f;
            f.__x = static_cast<__nv_fp8_storage_t>((w[e / 4] >> (8 * (e % 4))) & 0xff);
            v[e] = bf16_round(__fmul_rn(static_cast<float>(f), s));
            amax = fmaxf(amax, fabsf(v[e]));
        }
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, 2));
    if (!active) return;
    const bool tiny = amax < 1e-4f;
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
        const bf16 lo = __float2bfloat16_rn(requant(v[e], tiny));
        const bf16 hi = __float2bfloat16_rn(requant(v[e + 1], tiny));
        o[e / 2] = static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
                   (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
    }
    reinterpret_cast<uint4*>(dst)[i] = out;
}

__device__ __forceinline__ void zero_row(bf16* dst, uint32_t width, uint32_t lane) {
    for (uint32_t i = lane; i < width / 8; i += kWarp) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
}

// What the lookup kernels read to find an item's row (the module comment's hash).
struct Hash {
    const uint32_t *tokens, *cu_seqlens, *slots;
    history::TokenCode code;
    const uint32_t *hist, *state;
    const uint64_t *mult, *primes, *offsets, *tables;
    uint8_t* text_out;
    uint32_t* ctrl;
    uint32_t rows, num_seqs, per_seq, max_seqs, hist_len, vocab, pad, max_ngram, heads;
};

constexpr uint64_t kNoRow = ~0ull;  // an item whose row is zeros
constexpr uint32_t kErrStaging = 32;  // rows read before the host staged them (layers: DecodeError.STAGING)

// Warp-uniform, every lane calls it: item (l, j, r)'s row among this rank's rows of table l, or
// kNoRow where the row is zeros (padding, a bad or non-text row, another rank's row). The row's
// first item (`first`) writes its text flag and raises its flags.
__device__ __forceinline__ uint64_t item_row(const Hash& a, uint32_t l, uint32_t j, uint32_t r, bool first,
                                             uint32_t lane) {
    const uint32_t s = history::seq_of(a.cu_seqlens, a.per_seq, a.num_seqs, r);
    const history::Span sp = history::span_of(a.cu_seqlens, a.per_seq, s);
    const uint32_t slot = __ldg(a.slots + s);
    const uint32_t token = __ldg(a.tokens + r);
    const history::RowCheck check = history::check_row(sp, r, a.rows, slot, token, a.max_seqs, a.vocab);
    const bool text_row = !check.skip && a.code.is_text(token, r);
    if (first && lane == 0) {
        if (check.flags) atomicOr(a.ctrl, check.flags);
        a.text_out[r] = text_row;
    }
    if (!text_row) return kNoRow;  // padding, a bad row, or a non-text one (its gate is 0: no row needed)
    // Lane k < N fetches entry k back; blocked from the first kNoToken on.
    const uint32_t at = r - sp.start;
    const uint32_t* h = a.hist + static_cast<uint64_t>(slot) * a.hist_len;
    const uint32_t pos = a.state[2 * slot];
    const uint32_t mine =
        lane < a.max_ngram ? history::entry_back(a.tokens, a.code, r, at, lane, h, pos, a.hist_len) : kNoToken;
    const uint32_t stops = __ballot_sync(kFull, mine == kNoToken);
    const uint32_t cut = static_cast<uint32_t>(__ffs(static_cast<int>(stops))) - 1;  // lane max_ngram.. stop
    const uint32_t cols = (a.max_ngram - 1) * a.heads, order = j / a.heads + 2;
    uint64_t hash = 0;
    for (uint32_t k = 0; k < order; ++k) {
        const uint32_t tk = __shfl_sync(kFull, mine, k);
        hash ^= static_cast<uint64_t>(k < cut ? tk : a.pad) * __ldg(a.mult + l * a.max_ngram + k);
    }
    const uint64_t id = hash % __ldg(a.primes + l * cols + j) + __ldg(a.offsets + l * cols + j);
    const Table t = load_table(a.tables, l);
    return id - t.lo < t.count ? id - t.lo : kNoRow;  // else another rank's (id < lo wraps above count)
}

// A packed row's values dequantised into dst (W bf16); zeros where row is null.
__device__ __forceinline__ void write_row(const uint8_t* row, uint32_t width, uint32_t lane, bf16* dst) {
    if (row == nullptr) {
        zero_row(dst, width, lane);
        return;
    }
    const uint32_t chunks = width / 8, passes = (chunks + kWarp - 1) / kWarp;
    for (uint32_t p = 0; p < passes; ++p) {
        const uint32_t i = p * kWarp + lane;
        copy_chunk(row, width, i, i < chunks, dst);
    }
}

// Item (l, j, r)'s row of emb [L, max_rows, C*W].
__device__ __forceinline__ bf16* emb_row(bf16* emb, uint32_t l, uint32_t j, uint32_t r, uint32_t max_rows,
                                         uint32_t cols, uint32_t width) {
    return emb + (static_cast<uint64_t>(l) * max_rows + r) * cols * width + static_cast<uint64_t>(j) * width;
}

}  // namespace

// emb [L, max_rows, C*W] bf16 (layer l's rows at emb + l * max_rows * C * W), text_out [rows] u8;
// mult [L, N], primes [L, C], offsets [L, C] u64; tables [L, 4] u64 (module comment).
extern "C" __global__ void engram_lookup(
    const uint32_t* tokens, const uint32_t* cu_seqlens, const uint32_t* slots, const uint8_t* text,
    uint32_t* hist, uint32_t* state, const int32_t* map, const uint64_t* mult,
    const uint64_t* primes, const uint64_t* offsets, const uint64_t* tables, bf16* emb,
    uint8_t* text_out, uint32_t* ctrl, uint32_t rows, uint32_t num_seqs, uint32_t per_seq,
    uint32_t max_rows, uint32_t max_seqs, uint32_t hist_len, uint32_t vocab, uint32_t dead,
    uint32_t pad, uint32_t layers, uint32_t max_ngram, uint32_t heads, uint32_t width,
    uint32_t stride) {
    pdl_launch_dependents();  // the GEMMs may start streaming their weights (they wait for emb)
    const history::TokenCode code{map, text, vocab, dead};
    const Hash a{tokens, cu_seqlens, slots, code, hist, state, mult, primes, offsets, tables, text_out, ctrl,
                 rows, num_seqs, per_seq, max_seqs, hist_len, vocab, pad, max_ngram, heads};
    const uint32_t lane = threadIdx.x % kWarp;
    const uint32_t cols = (max_ngram - 1) * heads;
    const uint64_t items = static_cast<uint64_t>(layers) * cols * rows;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    for (uint64_t item = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
         item < items; item += warps) {  // warp-uniform
        const uint32_t r = static_cast<uint32_t>(item % rows);
        const uint32_t lj = static_cast<uint32_t>(item / rows), l = lj / cols, j = lj % cols;
        const uint64_t row = item_row(a, l, j, r, lj == 0, lane);
        const uint8_t* data = reinterpret_cast<const uint8_t*>(load_table(tables, l).data);
        write_row(row == kNoRow ? nullptr : data + row * stride, width, lane,
                  emb_row(emb, l, j, r, max_rows, cols, width));
    }
    if (history::last_block(ctrl + 1))
        history::commit(tokens, code, cu_seqlens, slots, hist, state, ctrl, rows, num_seqs, per_seq,
                        max_seqs, hist_len);
}

// The staged lookup's first half (layers/engram/host_staging.py): engram_lookup's hash, text
// flags, error bits and history update, with each item's row written to ids instead of read:
// ids[0] = rows | gen << 32, ids[1 + (l * rows + r) * C + j] = item (l, j, r)'s row (kNoRow:
// zeros), where gen = ++gen[0], this call's number (the host stamps each chunk it stages with it).
extern "C" __global__ void engram_row_ids(
    const uint32_t* tokens, const uint32_t* cu_seqlens, const uint32_t* slots, const uint8_t* text,
    uint32_t* hist, uint32_t* state, const int32_t* map, const uint64_t* mult,
    const uint64_t* primes, const uint64_t* offsets, const uint64_t* tables, uint64_t* ids, uint32_t* gen,
    uint8_t* text_out, uint32_t* ctrl, uint32_t rows, uint32_t num_seqs, uint32_t per_seq,
    uint32_t max_seqs, uint32_t hist_len, uint32_t vocab, uint32_t dead, uint32_t pad, uint32_t layers,
    uint32_t max_ngram, uint32_t heads) {
    const history::TokenCode code{map, text, vocab, dead};
    const Hash a{tokens, cu_seqlens, slots, code, hist, state, mult, primes, offsets, tables, text_out, ctrl,
                 rows, num_seqs, per_seq, max_seqs, hist_len, vocab, pad, max_ngram, heads};
    const uint32_t lane = threadIdx.x % kWarp;
    const uint32_t cols = (max_ngram - 1) * heads;
    const uint64_t items = static_cast<uint64_t>(layers) * cols * rows;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const uint32_t g = gen[0] + 1;
        gen[0] = g;
        ids[0] = rows | static_cast<uint64_t>(g) << 32;
    }
    for (uint64_t item = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
         item < items; item += warps) {  // warp-uniform; item = (l * rows + r) * C + j
        const uint32_t j = static_cast<uint32_t>(item % cols);
        const uint32_t lr = static_cast<uint32_t>(item / cols), l = lr / rows, r = lr % rows;
        const uint64_t row = item_row(a, l, j, r, l == 0 && j == 0, lane);
        if (lane == 0) ids[1 + item] = row;
    }
    if (history::last_block(ctrl + 1))
        history::commit(tokens, code, cu_seqlens, slots, hist, state, ctrl, rows, num_seqs, per_seq,
                        max_seqs, hist_len);
}

// The staged lookup's second half, rows r0 .. r1 (chunk `chunk`) of every layer: item (l, j, r)'s
// row dequantised into emb as engram_lookup writes it; zeros where ids[1 + item] is kNoRow. A
// layer whose bit is set in `staged` reads the row the host staged at staged + item * stride
// (pinned host memory mapped for the device), with item = (l * rows + r) * C + j, once the host
// has stamped the chunk ready[chunk] == gen[0] (ready: device memory, the host's stamp copied
// there after the chunk's wait); where it has not (its wait returned early), the rows are zeros
// and ctrl[0] gets kErrStaging. Another layer reads its table (device memory).
extern "C" __global__ void engram_staged_rows(const uint64_t* ids, const uint8_t* staged, const uint64_t* tables,
                                              const uint32_t* gen, const uint32_t* ready, uint32_t* ctrl,
                                              bf16* emb, uint32_t rows, uint32_t r0, uint32_t r1, uint32_t chunk,
                                              uint32_t max_rows, uint32_t layers, uint32_t cols, uint32_t width,
                                              uint32_t stride, uint32_t staged_layers) {
    pdl_launch_dependents();  // the GEMMs may start streaming their weights (they wait for emb)
    const uint32_t lane = threadIdx.x % kWarp, span = r1 - r0;
    const bool stamped = *reinterpret_cast<const volatile uint32_t*>(ready + chunk) == gen[0];
    const uint64_t items = static_cast<uint64_t>(layers) * span * cols;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
    for (uint64_t i = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; i < items;
         i += warps) {  // warp-uniform; i = (l * span + (r - r0)) * C + j
        const uint32_t j = static_cast<uint32_t>(i % cols);
        const uint32_t lr = static_cast<uint32_t>(i / cols), l = lr / span, r = r0 + lr % span;
        const uint64_t item = (static_cast<uint64_t>(l) * rows + r) * cols + j;
        const uint64_t row = __ldg(ids + 1 + item);
        const uint8_t* src = nullptr;
        if (row != kNoRow && (staged_layers >> l & 1u) == 0) {
            src = reinterpret_cast<const uint8_t*>(load_table(tables, l).data) + row * stride;
        } else if (row != kNoRow && stamped) {
            src = staged + item * stride;
        } else if (row != kNoRow && lane == 0) {
            atomicOr(ctrl, kErrStaging);
        }
        write_row(src, width, lane, emb_row(emb, l, j, r, max_rows, cols, width));
    }
}

// x [rows, hc, dim] bf16 updated in place where text[t]; kv [rows, kv_stride] bf16 (keys, then
// the value); q, k [hc, dim] bf16. Block (t, c) = blockIdx.x / hc, blockIdx.x % hc.
extern "C" __global__ void engram_gate(bf16* x, const bf16* kv, const bf16* q, const bf16* k,
                                       const uint8_t* text, uint32_t rows, uint32_t hc, uint32_t dim,
                                       uint32_t kv_stride, float eps) {
    pdl_wait();  // kv and text come from the kernels before
    const uint32_t t = blockIdx.x / hc, c = blockIdx.x % hc;
    if (t >= rows || !__ldg(text + t)) return;  // block-uniform
    bf16* xr = x + (static_cast<uint64_t>(t) * hc + c) * dim;
    const bf16* key = kv + static_cast<uint64_t>(t) * kv_stride + static_cast<uint64_t>(c) * dim;
    const bf16* value = kv + static_cast<uint64_t>(t) * kv_stride + static_cast<uint64_t>(hc) * dim;
    const bf16* qc = q + static_cast<uint64_t>(c) * dim;
    const bf16* kc = k + static_cast<uint64_t>(c) * dim;
    float dot = 0.0f, xx = 0.0f, kk = 0.0f;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float xv = __bfloat162float(xr[i]), kv_ = __bfloat162float(__ldg(key + i));
        const float w = __fmul_rn(__bfloat162float(__ldg(qc + i)), __bfloat162float(__ldg(kc + i)));
        dot = fmaf(__fmul_rn(xv, w), kv_, dot);
        xx = fmaf(xv, xv, xx);
        kk = fmaf(kv_, kv_, kk);
    }
    __shared__ float part[3][32];
    for (int off = 16; off > 0; off >>= 1) {
        dot += __shfl_xor_sync(kFull, dot, off);
        xx += __shfl_xor_sync(kFull, xx, off);
        kk += __shfl_xor_sync(kFull, kk, off);
    }
    const uint32_t warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp;
    if (threadIdx.x % kWarp == 0) {
        part[0][warp] = dot;
        part[1][warp] = xx;
        part[2][warp] = kk;
    }
    __syncthreads();
    dot = xx = kk = 0.0f;
    for (uint32_t w = 0; w < nwarps; ++w) {  // every thread, in one order: the same sums everywhere
        dot += part[0][w];
        xx += part[1][w];
        kk += part[2][w];
    }
    const float n = static_cast<float>(dim);
    const float d = dot * rsqrtf(xx / n + eps) * rsqrtf(kk / n + eps) * rsqrtf(n);
    const float g = 1.0f / (1.0f + expf(-copysignf(sqrtf(fmaxf(fabsf(d), 1e-6f)), d)));
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        xr[i] = __float2bfloat16_rn(fmaf(g, __bfloat162float(__ldg(value + i)), __bfloat162float(xr[i])));
}
