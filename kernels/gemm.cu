// Dense bf16 GEMM on tensor cores: c[m,n] = a[m,k] @ w[n,k]^T.
//
// Both operands are K-major (row i of a at a + i*k, row j of w at w + j*k), c is row-major
// [m, n]. Products are accumulated in fp32 and rounded once to bf16 (__float2bfloat16_rn).
// Every path ends in the same store (store_pair, or the simt loop), templated on an epilogue that
// maps each fp32 accumulator before that one rounding:
//   PlainEpilogue  nothing: c = bf16(acc) (the plain entry points; same code as without it);
//   WordEpilogue   c[i, j] = bf16((acc + float(word[word_ids[i] * n + j])) * scale), one fp32
//                  add and one fp32 multiply (__fadd_rn, __fmul_rn: never contracted to an FMA),
//                  then the one rounding: the fused n-gram embedding's word row and 1/(1+T).
// Every entry point is correct for any m, n, k >= 1 (k < 2^31, which the launcher enforces),
// any grid (all paths loop over their work items grid-stride), unaligned pointers and odd sizes:
//   fast loads  (k % 8 == 0 && aligned16(a, w)): 16-byte cp.async.cg, zero-filled (src-size 0)
//               past the m / n / k edges;
//   slow loads  (otherwise): eight scalar bf16 loads with per-element bounds, stored to the same
//               shared-memory slot, so the compute code is shared;
//   c stores    bf16x2 when n is even and c is 4-byte aligned, scalar otherwise.
// A launch whose block is not 256x1x1 or whose dynamic shared memory is below what its path needs
// runs the scalar fallback (gemm_simt): slow but correct, so no launch shape gives wrong output.
//
// Paths (256 threads = 8 warps each):
//   small   m <= 64 (decode; bound by reading w once). A work item is 32 columns of c (two m16
//           tiles of w rows) for up to 64 rows of a (NT = 1, 2, 4 or 8 n8 tiles of a rows, from
//           min(m, 64)). The K loop is split across the 8 warps (warp i takes 32-wide k-chunks
//           i, i+8, ...). w is the mma A operand, a the B operand (mma m16n8k16: 16 w rows x 8 a
//           rows). Each lane loads 16 contiguous bytes (8 k) of each row it needs; the k order
//           inside a chunk is permuted identically for both operands, so every lane reads back
//           exactly the bytes it copied itself (no cross-lane shared-memory traffic, no barrier in
//           the K loop). cp.async ring per warp, 6 stages (4 for NT = 8). Partial fp32
//           accumulators are reduced across warps through shared memory in a fixed order: still
//           one rounding, no workspace. Shared memory: 8 warps x stages x (4 + NT) x 512 B =
//           120 KB (NT=1), 144 KB (NT=2), 192 KB (NT=4, NT=8).
//   tiled   mma.sync m16n8k16 bf16, CTA tile BM x BN x 32, warps 2 (M) x 4 (N), 4-stage cp.async
//           pipeline (one __syncthreads per k-tile), ldmatrix.x4 from an XOR-swizzled layout
//           (16-byte chunk c of row r stored at chunk c ^ ((r >> 1) & 3): conflict-free for both
//           the cp.async stores and the ldmatrix reads), grouped rasterization (16 tile rows).
//           Configs: L = 128x256 (warp tile 64x64, 96 KB), M = 128x128 (64 KB), S = 64x64 (32 KB),
//           the largest that the dynamic shared memory given holds: the launcher chooses by shape
//           (the largest config with >= 128 tiles and little padding, else S).
//   wgmma   sm_90a only: CTA tile 128x256x64, two warpgroups each issuing wgmma m64n256k16 (both
//           operands K-major from shared memory, 128-byte swizzle, 1024-byte-aligned stages),
//           4 stages filled by cp.async two k-tiles ahead; after a stage lands every thread runs
//           fence.proxy.async.shared::cta, then __syncthreads, then the wgmma reads it. 192 KB + 1 KB
//           for alignment. Without sm_90a features this entry point runs the tiled path instead.
//   simt    one output per thread, fp32 fma chain: the fallback, and a reference on the device.
//
// Entry points (same signature; the launcher layers/ops/gemm.py mirrors every size constant here):
//   dense_gemm_bf16_pipelined  the contract's kernel: small for m <= 64, else tiled (config from
//                              the dynamic shared memory, as dense_gemm_bf16_tiled);
//   dense_gemm_bf16_small_m    small path for any m (rows in blocks of 64);
//   dense_gemm_bf16_tiled      tiled path, config chosen by the dynamic shared memory given
//                              (>= 96 KB: L, >= 64 KB: M, >= 32 KB: S);
//   dense_gemm_bf16_wgmma      wgmma path (needs >= 197632 bytes of dynamic shared memory);
//   dense_gemm_bf16_simt       the scalar path.
// Word-row entry points (the plain signature + const uint32_t* word_ids, const bf16* word [vocab,
// n] row-major, float scale; same launch plans as their plain twins):
//   dense_gemm_bf16_word       as dense_gemm_bf16_pipelined, with the word epilogue;
//   dense_gemm_bf16_word_wgmma as dense_gemm_bf16_wgmma, with the word epilogue.
// Both may be launched as programmatic dependents of the gather that writes a and word_ids
// (they wait for it before reading either; the small path requests its first w stages first).
// word_ids are not bounds-checked here (the kernel is not told the vocabulary size): the caller
// guarantees word_ids[i] < vocab or word_ids[i] == 0xFFFFFFFF (that row is written as zeros).
#include "common.cuh"

namespace gemm {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;

// small path
constexpr uint32_t kSmallMaxRows = 64;  // rows of a per work item (8 n8 tiles)
constexpr uint32_t kSmallCols = 32;     // columns of c per work item (2 m16 tiles of w rows)
constexpr uint32_t kSmallStages = 6;     // cp.async ring depth per warp for NT <= 4
constexpr uint32_t kSmallStagesNT8 = 4;  // ... and for NT = 8 (shared memory bound)
constexpr uint32_t kSmallChunk = 32;    // k per stage: 8 per lane in each of the 4 lanes of a row
constexpr uint32_t kSmallWPieces = 4;   // 16-byte w pieces per lane per stage (2 tiles x 2 rows)
constexpr uint32_t kPieceBytes = 32 * 16;  // one 16-byte piece for each lane of a warp
constexpr uint32_t kRedStride = kSmallCols + 4;  // floats per reduction row: conflict-free stores

// tiled path
constexpr uint32_t kTileK = 32;
constexpr uint32_t kTileStages = 4;
constexpr uint32_t kTileRowBytes = kTileK * 2;  // 64: four 16-byte chunks per tile row
constexpr uint32_t kGroupM = 16;                 // tile rows per rasterization group

extern __shared__ __align__(1024) unsigned char smem_raw[];

// -- small helpers ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

__device__ __forceinline__ bool block_is_256() {
    return blockDim.x == kThreads && blockDim.y == 1 && blockDim.z == 1;
}

__device__ __forceinline__ uint64_t block_rank() {
    return blockIdx.x + static_cast<uint64_t>(gridDim.x) *
                            (blockIdx.y + static_cast<uint64_t>(gridDim.y) * blockIdx.z);
}

__device__ __forceinline__ uint64_t grid_blocks() {
    return static_cast<uint64_t>(gridDim.x) * gridDim.y * gridDim.z;
}

__device__ __forceinline__ uint32_t ceil_div(uint32_t x, uint32_t d) {
    return x / d + (x % d != 0);
}

__device__ __forceinline__ bool fast_loads(const bf16* a, const bf16* w, uint32_t k) {
    return (k % 8 == 0) && aligned16(a, w);
}

__device__ __forceinline__ bool vector_stores(const bf16* c, uint32_t n) {
    return (n % 2 == 0) && ((reinterpret_cast<uintptr_t>(c) & 3) == 0);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void st_shared16(uint32_t dst, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ uint4 ld_shared16(uint32_t src) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src) : "memory");
    return v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(src) : "memory");
}

// d += A (16x16, row) * B (16x8, col); bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Elements kk .. kk+7 of one row, zero past k: the loader for unaligned rows or k % 8 != 0.
__device__ __forceinline__ uint4 load8_scalar(const bf16* row, uint32_t kk, uint32_t k) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row);
    uint32_t e[8];
#pragma unroll
    for (uint32_t j = 0; j < 8; ++j) e[j] = (kk + j < k) ? static_cast<uint32_t>(__ldg(p + kk + j)) : 0u;
    return make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16),
                      e[6] | (e[7] << 16));
}

// Compile-time flag for the loaders, so each k-step branches once on the uniform `fast`.
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// One 16-byte slot of shared memory <- elements kk .. kk+7 of `row`, or zeros when !ok.
// Fast: cp.async (src-size 0 zero-fills and reads nothing; `row` is then any valid address).
// Row pointers of `kLoads` rows row0, row0 + stride, ... of a K-major operand, and whether each
// row exists (a missing row reads row 0 with a zero-fill predicate, never past the operand).
template <uint32_t kLoads>
__device__ __forceinline__ void row_sources(const bf16* base, uint32_t row0, uint32_t stride,
                                            uint32_t rows, uint32_t k, const bf16* (&src)[kLoads],
                                            bool (&ok)[kLoads]) {
#pragma unroll
    for (uint32_t i = 0; i < kLoads; ++i) {
        const uint32_t r = row0 + i * stride;
        ok[i] = r < rows;
        src[i] = base + static_cast<uint64_t>(ok[i] ? r : 0) * k;
    }
}

template <bool kFast>
__device__ __forceinline__ void load_slot(uint32_t dst, const bf16* row, bool ok, uint32_t kk,
                                          uint32_t k) {
    if (kFast) {
        cp_async16(dst, ok ? row + kk : row, ok ? 16u : 0u);
    } else {
        st_shared16(dst, ok ? load8_scalar(row, kk, k) : make_uint4(0u, 0u, 0u, 0u));
    }
}

// -- epilogues: the fp32 value each accumulator becomes just before its one bf16 rounding ------
// ep.row(row, m) gives the row's epilogue, taken once per output row a thread stores (hoisted out
// of the column loops); for row >= m it is a harmless dummy that is never applied. Its
// apply(col, v) maps one element, apply2(col, v0, v1) the pair (col, col + 1) of a vector store
// (n even, col even, so col + 1 < n). Everything is inlined into every path's store, so a path is
// written once and instantiated per epilogue; the plain one compiles to the code it replaced.
struct PlainEpilogue {
    struct Row {
        __device__ __forceinline__ float apply(uint32_t, float v) const { return v; }
        __device__ __forceinline__ void apply2(uint32_t, float&, float&) const {}
    };
    __device__ __forceinline__ Row row(uint64_t, uint32_t) const { return Row{}; }
};

// (acc + float(word[word_ids[row] * n + col])) * scale: fp32 add, fp32 multiply, no contraction.
// A word id of kNoWord (0xFFFFFFFF) writes the row as zeros (ngram_decode.cu's rows of bad input).
constexpr uint32_t kNoWord = 0xffffffff;
struct WordEpilogue {
    const uint32_t* ids;
    const bf16* word;  // [vocab, n] row-major
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
    };
    __device__ __forceinline__ Row row(uint64_t r, uint32_t m) const {
        const uint32_t id = r < m ? __ldg(ids + r) : 0u;  // word_ids has m entries
        return Row{id == kNoWord ? nullptr : word + static_cast<uint64_t>(id) * n, scale, pairs};
    }
};

__device__ __forceinline__ WordEpilogue word_epilogue(const uint32_t* ids, const bf16* word,
                                                      uint32_t n, float scale) {
    return WordEpilogue{ids, word, n, scale, (reinterpret_cast<uintptr_t>(word) & 3) == 0};
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

// -- simt: any launch shape ------------------------------------------------------------------
template <class Ep>
__device__ void gemm_simt(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                          const Ep& ep) {
    const uint64_t block = static_cast<uint64_t>(blockDim.x) * blockDim.y * blockDim.z;
    const uint64_t tid = block_rank() * block + threadIdx.x +
                         static_cast<uint64_t>(blockDim.x) * (threadIdx.y + static_cast<uint64_t>(blockDim.y) * threadIdx.z);
    const uint64_t stride = grid_blocks() * block;
    const uint64_t total = static_cast<uint64_t>(m) * n;
    for (uint64_t i = tid; i < total; i += stride) {
        const uint64_t row = i / n, col = i % n;
        const bf16* ar = a + row * k;
        const bf16* wr = w + col * k;
        float s = 0.0f;
        for (uint32_t kk = 0; kk < k; ++kk)
            s = fmaf(__bfloat162float(ar[kk]), __bfloat162float(wr[kk]), s);
        c[i] = __float2bfloat16_rn(ep.row(row, m).apply(static_cast<uint32_t>(col), s));
    }
}

// -- small path ------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t small_nt(uint32_t m) {
    const uint32_t rows = m < kSmallMaxRows ? m : kSmallMaxRows;
    return rows <= 8 ? 1 : rows <= 16 ? 2 : rows <= 32 ? 4 : 8;
}

__host__ __device__ constexpr uint32_t small_stages(uint32_t nt) {
    return nt >= 8 ? kSmallStagesNT8 : kSmallStages;
}

__device__ __forceinline__ uint32_t small_smem_bytes(uint32_t m) {
    const uint32_t nt = small_nt(m);
    return kWarps * small_stages(nt) * (kSmallWPieces + nt) * kPieceBytes;
}

// Lane (g = lane / 4, t = lane % 4) of a warp copies, per 32-wide k-chunk, k = chunk*32 + 8t ..
// +7 of: w rows col0 + 16i + 8h + g (piece 2i + h; i = w tile, h = upper 8 rows) and a rows
// row0 + 8j + g (piece 4 + j). mma k-slots 2t, 2t+1 (then 2t+8, 2t+9) take the lane's elements
// 0-1 (2-3) in the first mma of the chunk and 4-5 (6-7) in the second; a and w agree on this
// permutation of k, so each product pairs equal k.
template <uint32_t NT, class Ep>
__device__ __forceinline__ void small_m_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                             uint32_t n, uint32_t k, const Ep& ep) {
    constexpr uint32_t kStages = small_stages(NT);
    constexpr uint32_t kPieces = kSmallWPieces + NT;
    constexpr uint32_t kStageBytes = kPieces * kPieceBytes;
    constexpr uint32_t kRedRows = NT * 8;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t g = lane >> 2, t = lane & 3;
    const bool fast = fast_loads(a, w, k);
    const bool vec = vector_stores(c, n);
    const uint32_t chunks = ceil_div(k, kSmallChunk);
    const uint32_t mine = warp < chunks ? (chunks - warp + kWarps - 1) / kWarps : 0;
    const uint32_t ring = smem_u32(smem_raw) + warp * kStages * kStageBytes + lane * 16;
    float* red = reinterpret_cast<float*>(smem_raw);
    const uint64_t slices = ceil_div(n, kSmallCols);
    const uint64_t items = slices * ceil_div(m, kSmallMaxRows);

    for (uint64_t item = block_rank(); item < items; item += grid_blocks()) {
        const uint32_t col0 = static_cast<uint32_t>(item % slices) * kSmallCols;
        const uint32_t row0 = static_cast<uint32_t>(item / slices) * kSmallMaxRows;
        const bf16* wsrc[kSmallWPieces];
        bool wok[kSmallWPieces];
#pragma unroll
        for (uint32_t p = 0; p < kSmallWPieces; ++p) {
            const uint32_t r = col0 + 16 * (p >> 1) + 8 * (p & 1) + g;
            wok[p] = r < n;
            wsrc[p] = w + static_cast<uint64_t>(wok[p] ? r : 0) * k;
        }
        const bf16* asrc[NT];
        bool aok[NT];
        row_sources(a, row0 + g, 8, m, k, asrc, aok);
        // parts: 1 = the w pieces of a stage, 2 = its a pieces, 3 = both.
        auto load_as = [&](auto flag, uint32_t stage, uint32_t chunk, uint32_t parts) {
            constexpr bool kFast = decltype(flag)::value;
            const uint32_t kk = chunk * kSmallChunk + 8 * t;
            const bool kin = kk < k;
            const uint32_t dst = ring + stage * kStageBytes;
            if (parts & 1) {
#pragma unroll
                for (uint32_t p = 0; p < kSmallWPieces; ++p)
                    load_slot<kFast>(dst + p * kPieceBytes, wsrc[p], wok[p] && kin, kk, k);
            }
            if (parts & 2) {
#pragma unroll
                for (uint32_t j = 0; j < NT; ++j)
                    load_slot<kFast>(dst + (kSmallWPieces + j) * kPieceBytes, asrc[j], aok[j] && kin, kk, k);
            }
        };
        auto load = [&](uint32_t stage, uint32_t chunk, uint32_t parts = 3) {
            if (fast) load_as(Flag<true>{}, stage, chunk, parts);
            else load_as(Flag<false>{}, stage, chunk, parts);
        };

        float acc[2][NT][4];
#pragma unroll
        for (uint32_t i = 0; i < 2; ++i)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        // One commit group per chunk (empty ones too), so wait_group counts chunks. The first
        // item's w pieces of the first stages are requested before pdl_wait (a no-op unless this
        // is a programmatic dependent launch): the weights do not depend on the kernel before,
        // a does. The first group then holds those w pieces too, which only makes it wait longer.
        const bool first = item == block_rank();
        if (first) {
#pragma unroll
            for (uint32_t s = 0; s < kStages - 1; ++s)
                if (s < mine) load(s, warp + s * kWarps, 1);
            pdl_wait();
        }
#pragma unroll
        for (uint32_t s = 0; s < kStages - 1; ++s) {
            if (s < mine) load(s, warp + s * kWarps, first ? 2 : 3);
            cp_async_commit();
        }
        for (uint32_t i = 0; i < mine; ++i) {
            cp_async_wait<kStages - 2>();  // this lane's copies of chunk i have landed
            // Refill the stage read in iteration i-1 (its values were consumed by that
            // iteration's mma, and only this lane ever touches its slots).
            const uint32_t next = i + kStages - 1;
            if (next < mine) load(next % kStages, warp + next * kWarps);
            cp_async_commit();
            const uint32_t src = ring + (i % kStages) * kStageBytes;
            uint4 wv[kSmallWPieces], av[NT];
#pragma unroll
            for (uint32_t p = 0; p < kSmallWPieces; ++p) wv[p] = ld_shared16(src + p * kPieceBytes);
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j) av[j] = ld_shared16(src + (kSmallWPieces + j) * kPieceBytes);
#pragma unroll
            for (uint32_t ti = 0; ti < 2; ++ti) {
                const uint4 lo = wv[2 * ti], hi = wv[2 * ti + 1];  // w rows g and g + 8
#pragma unroll
                for (uint32_t j = 0; j < NT; ++j) {
                    mma_bf16(acc[ti][j], lo.x, hi.x, lo.y, hi.y, av[j].x, av[j].y);
                    mma_bf16(acc[ti][j], lo.z, hi.z, lo.w, hi.w, av[j].z, av[j].w);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with its ring: reuse the memory for the reduction

        // acc[ti][j]: e0 (w row 16ti+g, a row 8j+2t), e1 (same w row, a row +1), e2/e3 (w row +8).
        float* mine_red = red + warp * (kRedRows * kRedStride);
#pragma unroll
        for (uint32_t ti = 0; ti < 2; ++ti)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j) {
                const uint32_t r = 8 * j + 2 * t, col = 16 * ti + g;
                mine_red[r * kRedStride + col] = acc[ti][j][0];
                mine_red[(r + 1) * kRedStride + col] = acc[ti][j][1];
                mine_red[r * kRedStride + col + 8] = acc[ti][j][2];
                mine_red[(r + 1) * kRedStride + col + 8] = acc[ti][j][3];
            }
        __syncthreads();

        const uint32_t rows = (m - row0) < kSmallMaxRows ? (m - row0) : kSmallMaxRows;  // <= kRedRows
        for (uint32_t idx = threadIdx.x; idx < rows * (kSmallCols / 2); idx += kThreads) {
            const uint32_t r = idx / (kSmallCols / 2), col = 2 * (idx % (kSmallCols / 2));
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (uint32_t wp = 0; wp < kWarps; ++wp) {  // fixed order: deterministic
                const float* src = red + wp * (kRedRows * kRedStride) + r * kRedStride + col;
                s0 += src[0];
                s1 += src[1];
            }
            const uint64_t row = static_cast<uint64_t>(row0) + r;
            store_pair(c, row, col0 + col, n, s0, s1, vec, ep.row(row, m));
        }
        __syncthreads();  // the next item's copies overwrite the reduction buffer
    }
}

template <class Ep>
__device__ __forceinline__ bool run_small(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                          uint32_t n, uint32_t k, const Ep& ep) {
    if (!block_is_256() || dynamic_smem_bytes() < small_smem_bytes(m)) return false;
    switch (small_nt(m)) {
        case 1: small_m_gemm<1>(a, w, c, m, n, k, ep); break;
        case 2: small_m_gemm<2>(a, w, c, m, n, k, ep); break;
        case 4: small_m_gemm<4>(a, w, c, m, n, k, ep); break;
        default: small_m_gemm<8>(a, w, c, m, n, k, ep); break;
    }
    return true;
}

// -- tiled path ------------------------------------------------------------------------------
template <uint32_t BM, uint32_t BN>
__host__ __device__ constexpr uint32_t tile_smem_bytes() {
    return kTileStages * (BM + BN) * kTileRowBytes;
}

// Byte offset of 16-byte chunk `ch` of tile row `r` (64-byte rows, XOR swizzle).
__device__ __forceinline__ uint32_t tile_offset(uint32_t r, uint32_t ch) {
    return r * kTileRowBytes + ((ch ^ ((r >> 1) & 3)) << 4);
}

// (tile row, tile column) of linear tile `tile`: column-major inside groups of kGroupM tile
// rows, so the CTAs running at once share a few rows of a and columns of w in L2.
__device__ __forceinline__ void grouped_tile(uint64_t tile, uint64_t tiles_m, uint64_t tiles_n,
                                             uint64_t& tm, uint64_t& tn) {
    const uint64_t group = static_cast<uint64_t>(kGroupM) * tiles_n;
    const uint64_t first_m = (tile / group) * kGroupM;
    const uint64_t left = tiles_m - first_m;
    const uint64_t rows = left < kGroupM ? left : kGroupM;
    const uint64_t in_group = tile % group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
}

template <uint32_t BM, uint32_t BN, class Ep>
__device__ __forceinline__ void tiled_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                           uint32_t n, uint32_t k, const Ep& ep) {
    constexpr uint32_t WM = BM / 2, WN = BN / 4;      // warp tile: warps 2 (M) x 4 (N)
    constexpr uint32_t MT = WM / 16, NT = WN / 8;     // mma tiles per warp
    constexpr uint32_t kABytes = BM * kTileRowBytes;
    constexpr uint32_t kStageBytes = (BM + BN) * kTileRowBytes;
    constexpr uint32_t kRowsPerPass = kThreads / 4;   // 64 rows of 4 chunks per pass of the CTA
    constexpr uint32_t kALoads = BM / kRowsPerPass, kBLoads = BN / kRowsPerPass;
    static_assert(NT % 2 == 0 && kALoads >= 1 && kBLoads >= 1, "tile config");

    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t wm = warp >> 2, wn = warp & 3, g = lane >> 2, t = lane & 3;
    const bool fast = fast_loads(a, w, k);
    const bool vec = vector_stores(c, n);
    const uint32_t base = smem_u32(smem_raw);
    const uint32_t ld_ch = tid & 3, ld_row = tid >> 2;
    // (r >> 1) & 3 is the same for rows ld_row + 64i, so one swizzled offset serves all passes.
    const uint32_t ld_off = tile_offset(ld_row, ld_ch);
    const uint32_t ktiles = ceil_div(k, kTileK);
    const uint64_t tiles_m = ceil_div(m, BM), tiles_n = ceil_div(n, BN);
    const uint64_t tiles = tiles_m * tiles_n;

    for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
        uint64_t tm, tn;
        grouped_tile(tile, tiles_m, tiles_n, tm, tn);
        const uint32_t m0 = static_cast<uint32_t>(tm) * BM, n0 = static_cast<uint32_t>(tn) * BN;
        const bf16* asrc[kALoads];
        bool aok[kALoads];
        row_sources(a, m0 + ld_row, kRowsPerPass, m, k, asrc, aok);
        const bf16* bsrc[kBLoads];
        bool bok[kBLoads];
        row_sources(w, n0 + ld_row, kRowsPerPass, n, k, bsrc, bok);
        auto load_as = [&](auto flag, uint32_t stage, uint32_t kt) {
            constexpr bool kFast = decltype(flag)::value;
            const uint32_t kk = kt * kTileK + ld_ch * 8;
            const bool kin = kk < k;
            const uint32_t sa = base + stage * kStageBytes + ld_off, sb = sa + kABytes;
#pragma unroll
            for (uint32_t i = 0; i < kALoads; ++i)
                load_slot<kFast>(sa + i * kRowsPerPass * kTileRowBytes, asrc[i], aok[i] && kin, kk, k);
#pragma unroll
            for (uint32_t i = 0; i < kBLoads; ++i)
                load_slot<kFast>(sb + i * kRowsPerPass * kTileRowBytes, bsrc[i], bok[i] && kin, kk, k);
        };
        auto load = [&](uint32_t stage, uint32_t kt) {
            if (fast) load_as(Flag<true>{}, stage, kt);
            else load_as(Flag<false>{}, stage, kt);
        };

        float acc[MT][NT][4];
#pragma unroll
        for (uint32_t i = 0; i < MT; ++i)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
        for (uint32_t s = 0; s < kTileStages - 1; ++s) {
            if (s < ktiles) load(s, s);
            cp_async_commit();
        }
        for (uint32_t kt = 0; kt < ktiles; ++kt) {
            cp_async_wait<kTileStages - 2>();  // this thread's copies of k-tile kt landed
            __syncthreads();                    // ... and everyone's; stage kt-1 is free
            const uint32_t next = kt + kTileStages - 1;
            if (next < ktiles) load(next % kTileStages, next);
            cp_async_commit();
            const uint32_t sa = base + (kt % kTileStages) * kStageBytes, sb = sa + kABytes;
#pragma unroll
            for (uint32_t ks = 0; ks < kTileK / 16; ++ks) {
                uint32_t af[MT][4], bfr[NT][2];
#pragma unroll
                for (uint32_t mt = 0; mt < MT; ++mt) {
                    // matrices: rows 0-7 / 8-15 of the m16 tile, k 0-7 / 8-15 -> a0, a1, a2, a3
                    const uint32_t r = wm * WM + mt * 16 + (lane & 15);
                    ldmatrix_x4(af[mt], sa + tile_offset(r, 2 * ks + (lane >> 4)));
                }
#pragma unroll
                for (uint32_t np = 0; np < NT / 2; ++np) {
                    // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                    const uint32_t r = wn * WN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    uint32_t q[4];
                    ldmatrix_x4(q, sb + tile_offset(r, 2 * ks + ((lane >> 3) & 1)));
                    bfr[2 * np][0] = q[0];
                    bfr[2 * np][1] = q[1];
                    bfr[2 * np + 1][0] = q[2];
                    bfr[2 * np + 1][1] = q[3];
                }
#pragma unroll
                for (uint32_t mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (uint32_t nt = 0; nt < NT; ++nt)
                        mma_bf16(acc[mt][nt], af[mt][0], af[mt][1], af[mt][2], af[mt][3],
                                 bfr[nt][0], bfr[nt][1]);
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // the next tile's prologue overwrites stages others may still read

#pragma unroll
        for (uint32_t mt = 0; mt < MT; ++mt) {
            const uint32_t row = m0 + wm * WM + mt * 16 + g;
            const auto e0 = ep.row(row, m), e8 = ep.row(row + 8, m);
#pragma unroll
            for (uint32_t nt = 0; nt < NT; ++nt) {
                const uint32_t col = n0 + wn * WN + nt * 8 + 2 * t;
                if (row < m) store_pair(c, row, col, n, acc[mt][nt][0], acc[mt][nt][1], vec, e0);
                if (row + 8 < m) store_pair(c, row + 8, col, n, acc[mt][nt][2], acc[mt][nt][3], vec, e8);
            }
        }
    }
}

// The largest tiled config the dynamic shared memory holds (the launcher sizes it to pick one).
template <class Ep>
__device__ __forceinline__ bool run_tiled(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                          uint32_t n, uint32_t k, const Ep& ep) {
    if (!block_is_256()) return false;
    const uint32_t dyn = dynamic_smem_bytes();
    if (dyn >= tile_smem_bytes<128, 256>()) {
        tiled_gemm<128, 256>(a, w, c, m, n, k, ep);
    } else if (dyn >= tile_smem_bytes<128, 128>()) {
        tiled_gemm<128, 128>(a, w, c, m, n, k, ep);
    } else if (dyn >= tile_smem_bytes<64, 64>()) {
        tiled_gemm<64, 64>(a, w, c, m, n, k, ep);
    } else {
        return false;
    }
    return true;
}

// -- wgmma path (sm_90a) ---------------------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr uint32_t kWgBM = 128;
constexpr uint32_t kWgBN = 256;
constexpr uint32_t kWgBK = 64;  // one 128-byte swizzle row
constexpr uint32_t kWgStages = 4;
constexpr uint32_t kWgABytes = kWgBM * kWgBK * 2;
constexpr uint32_t kWgStageBytes = (kWgBM + kWgBN) * kWgBK * 2;
constexpr uint32_t kWgSmem = kWgStages * kWgStageBytes + 1024;  // + alignment slack

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4)  // start address
           | (static_cast<uint64_t>(1) << 16)            // leading byte offset (unused here)
           | (static_cast<uint64_t>(1024 >> 4) << 32)    // stride byte offset
           | (static_cast<uint64_t>(1) << 62);           // 128-byte swizzle
}

__device__ __forceinline__ void wg_fence_operands(float (&d)[128]) {
#pragma unroll
    for (uint32_t i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1)
        : "memory");
}

// Tile 128 x 256: warpgroup wg computes rows 64*wg .. +63 with one m64n256k16 per 16 k.
// Stage layout (each 1024-byte aligned): A 128 rows, then B 256 rows, 128 bytes per row, the
// 16-byte chunk ch of row r at chunk ch ^ (r & 7): the 128-byte swizzle wgmma expects.
// Per k-tile kt: wait for its copies, fence.proxy.async, barrier, issue 4 wgmma, then copy k-tile
// kt+2 into the stage of kt-2 (whose wgmma every warpgroup retired before the barrier), then
// wait until at most the group just issued is pending.
template <class Ep>
__device__ __forceinline__ void wgmma_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                           uint32_t n, uint32_t k, const Ep& ep) {
    constexpr uint32_t kRowsPerPass = kThreads / 8;  // 32 rows of eight 16-byte chunks
    constexpr uint32_t kALoads = kWgBM / kRowsPerPass, kBLoads = kWgBN / kRowsPerPass;
    constexpr uint32_t kAhead = kWgStages - 2;       // k-tiles in flight ahead of the one computed
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t wg = warp >> 2, wq = warp & 3, g = lane >> 2, t = lane & 3;
    const bool fast = fast_loads(a, w, k);
    const bool vec = vector_stores(c, n);
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t ld_ch = tid & 7, ld_row = tid >> 3;
    // rows ld_row + 32i share (r & 7), hence one swizzled offset for every pass
    const uint32_t ld_off = ld_row * 128 + ((ld_ch ^ (ld_row & 7)) << 4);
    const uint32_t ktiles = ceil_div(k, kWgBK);
    const uint64_t tiles_m = ceil_div(m, kWgBM), tiles_n = ceil_div(n, kWgBN);
    const uint64_t tiles = tiles_m * tiles_n;

    for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
        uint64_t tm, tn;
        grouped_tile(tile, tiles_m, tiles_n, tm, tn);
        const uint32_t m0 = static_cast<uint32_t>(tm) * kWgBM, n0 = static_cast<uint32_t>(tn) * kWgBN;
        const bf16* asrc[kALoads];
        bool aok[kALoads];
        row_sources(a, m0 + ld_row, kRowsPerPass, m, k, asrc, aok);
        const bf16* bsrc[kBLoads];
        bool bok[kBLoads];
        row_sources(w, n0 + ld_row, kRowsPerPass, n, k, bsrc, bok);
        auto load_as = [&](auto flag, uint32_t stage, uint32_t kt) {
            constexpr bool kFast = decltype(flag)::value;
            const uint32_t kk = kt * kWgBK + ld_ch * 8;
            const bool kin = kk < k;
            const uint32_t sa = base + stage * kWgStageBytes + ld_off, sb = sa + kWgABytes;
#pragma unroll
            for (uint32_t i = 0; i < kALoads; ++i)
                load_slot<kFast>(sa + i * kRowsPerPass * 128, asrc[i], aok[i] && kin, kk, k);
#pragma unroll
            for (uint32_t i = 0; i < kBLoads; ++i)
                load_slot<kFast>(sb + i * kRowsPerPass * 128, bsrc[i], bok[i] && kin, kk, k);
        };
        auto load = [&](uint32_t stage, uint32_t kt) {
            if (fast) load_as(Flag<true>{}, stage, kt);
            else load_as(Flag<false>{}, stage, kt);
        };

        float d[128];
#pragma unroll
        for (uint32_t i = 0; i < 128; ++i) d[i] = 0.0f;

#pragma unroll
        for (uint32_t s = 0; s < kAhead; ++s) {
            if (s < ktiles) load(s, s);
            cp_async_commit();
        }
        for (uint32_t kt = 0; kt < ktiles; ++kt) {
            cp_async_wait<kAhead - 1>();  // this thread's copies of k-tile kt landed
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma
            __syncthreads();
            const uint32_t sa = base + (kt % kWgStages) * kWgStageBytes;
            const uint32_t sa_wg = sa + wg * 64 * 128, sb = sa + kWgABytes;
            wg_fence_operands(d);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (uint32_t ks = 0; ks < kWgBK / 16; ++ks)
                wgmma_m64n256k16(d, wg_desc(sa_wg + ks * 32), wg_desc(sb + ks * 32));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            const uint32_t next = kt + kAhead;
            if (next < ktiles) load(next % kWgStages, next);
            cp_async_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            wg_fence_operands(d);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_operands(d);
        cp_async_wait<0>();
        __syncthreads();  // both warpgroups retired their wgmma before the next prologue

        // d[4j + e]: row 16*wq + g (+8 for e >= 2), column 8j + 2t (+1 for odd e).
        const uint32_t row = m0 + wg * 64 + wq * 16 + g;
        const auto e0 = ep.row(row, m), e8 = ep.row(row + 8, m);
#pragma unroll
        for (uint32_t j = 0; j < kWgBN / 8; ++j) {
            const uint32_t col = n0 + 8 * j + 2 * t;
            if (row < m) store_pair(c, row, col, n, d[4 * j], d[4 * j + 1], vec, e0);
            if (row + 8 < m) store_pair(c, row + 8, col, n, d[4 * j + 2], d[4 * j + 3], vec, e8);
        }
    }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// -- entry bodies, shared by the plain and the word entry points -----------------------------
// small for m <= 64, tiled above (config from the shared memory), simt if the launch fits neither.
template <class Ep>
__device__ __forceinline__ void pipelined_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                               uint32_t n, uint32_t k, const Ep& ep) {
    const bool done = m <= kSmallMaxRows ? run_small(a, w, c, m, n, k, ep) : run_tiled(a, w, c, m, n, k, ep);
    if (!done) gemm_simt(a, w, c, m, n, k, ep);
}

// wgmma on sm_90a builds (simt if the launch does not fit it); elsewhere the tiled path.
template <class Ep>
__device__ __forceinline__ void wgmma_or_tiled_gemm(const bf16* a, const bf16* w, bf16* c,
                                                    uint32_t m, uint32_t n, uint32_t k, const Ep& ep) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (block_is_256() && dynamic_smem_bytes() >= kWgSmem) {
        wgmma_gemm(a, w, c, m, n, k, ep);
        return;
    }
    gemm_simt(a, w, c, m, n, k, ep);
#else
    if (!run_tiled(a, w, c, m, n, k, ep)) gemm_simt(a, w, c, m, n, k, ep);
#endif
}

}  // namespace gemm

// The contract's kernel: small path for m <= 64, tiled above (config from the shared memory).
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_pipelined(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::pipelined_gemm(a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// The small-m path for any m (work items of 32 columns x 64 rows).
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_small_m(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    using namespace gemm;
    if (!run_small(a, w, c, m, n, k, PlainEpilogue{})) gemm_simt(a, w, c, m, n, k, PlainEpilogue{});
}

// The mma.sync tiled path; config from the dynamic shared memory given (>= 96 KB: 128x256,
// >= 64 KB: 128x128, >= 32 KB: 64x64).
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_tiled(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    using namespace gemm;
    if (!run_tiled(a, w, c, m, n, k, PlainEpilogue{})) gemm_simt(a, w, c, m, n, k, PlainEpilogue{});
}

// The wgmma path (sm_90a builds); elsewhere the tiled path, as dense_gemm_bf16_tiled.
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_wgmma(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::wgmma_or_tiled_gemm(a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// One output per thread, any launch shape.
extern "C" __global__ void
dense_gemm_bf16_simt(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::gemm_simt(a, w, c, m, n, k, gemm::PlainEpilogue{});
}

namespace gemm {

// The word entry points run after the n-gram gather that writes a and word_ids, and may be
// launched overlapping it (programmatic dependent launch): they wait for it (pdl_wait) before
// reading a or word_ids. The small path requests its first weight stages before waiting.
template <class Ep>
__device__ __forceinline__ void dependent_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                               uint32_t n, uint32_t k, const Ep& ep) {
    if (m <= kSmallMaxRows && run_small(a, w, c, m, n, k, ep)) return;  // it waits itself
    pdl_wait();
    if (m <= kSmallMaxRows || !run_tiled(a, w, c, m, n, k, ep)) gemm_simt(a, w, c, m, n, k, ep);
}

}  // namespace gemm

// dense_gemm_bf16_pipelined with the word epilogue: c = bf16((a @ w^T + word[word_ids]) * scale).
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_word(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                     const uint32_t* word_ids, const bf16* word, float scale) {
    gemm::dependent_gemm(a, w, c, m, n, k, gemm::word_epilogue(word_ids, word, n, scale));
}

// dense_gemm_bf16_wgmma with the word epilogue.
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_word_wgmma(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n,
                           uint32_t k, const uint32_t* word_ids, const bf16* word, float scale) {
    pdl_wait();
    gemm::wgmma_or_tiled_gemm(a, w, c, m, n, k, gemm::word_epilogue(word_ids, word, n, scale));
}
