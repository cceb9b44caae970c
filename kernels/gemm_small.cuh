// Part of gemm.cu (included after its sizes): the small path, for m <= 64 (decode; bound by
// reading w once).
//
// A work item is 32 columns of c (two m16 tiles of w rows) for up to 64 rows of a (NT = 1, 2, 4 or
// 8 n8 tiles of a rows, from min(m, 64)). The K loop is split across the 8 warps (warp i takes
// 32-wide k-chunks i, i+8, ...). w is the mma A operand, a the B operand (mma m16n8k16: 16 w rows
// x 8 a rows). Each lane loads 16 contiguous bytes (8 k) of each row it needs; the k order inside
// a chunk is permuted identically for both operands, so every lane reads back exactly the bytes it
// copied itself (no cross-lane shared-memory traffic, no barrier in the K loop). cp.async ring per
// warp, 6 stages (4 for NT = 8). Partial fp32 accumulators are reduced across warps through shared
// memory in a fixed order: still one rounding, no workspace. Shared memory: 8 warps x stages x
// (4 + NT) x 512 B = 120 KB (NT=1), 144 KB (NT=2), 192 KB (NT=4, NT=8).
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_pipeline.cuh"

namespace gemm {

// Lane (g = lane / 4, t = lane % 4) of a warp copies, per 32-wide k-chunk, k = chunk*32 + 8t ..
// +7 of: w rows col0 + 8p + g (piece p: w tile p / 2, upper 8 rows for odd p) and a rows
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
    // This warp's chunks are warp, warp + 8, ...: its i-th is the pipeline's k-tile i.
    const CpAsyncRing<kStages, kStages - 1> pipe{mine};

    for (uint64_t item = block_rank(); item < items; item += grid_blocks()) {
        const uint32_t col0 = static_cast<uint32_t>(item % slices) * kSmallCols;
        const uint32_t row0 = static_cast<uint32_t>(item / slices) * kSmallMaxRows;
        const bf16* wsrc[kSmallWPieces];
        bool wok[kSmallWPieces];
        row_sources(w, col0 + g, 8, n, k, wsrc, wok);
        const bf16* asrc[NT];
        bool aok[NT];
        row_sources(a, row0 + g, 8, m, k, asrc, aok);
        // parts: 1 = the w pieces of a stage, 2 = its a pieces, 3 = both.
        auto load = [&](uint32_t stage, uint32_t i, uint32_t parts = 3) {
            with_load_kind(fast, [&](auto kind) {
                const uint32_t kk = (warp + i * kWarps) * kSmallChunk + 8 * t;
                const bool kin = kk < k;
                const uint32_t dst = ring + stage * kStageBytes;
                if (parts & 1) load_rows(kind, wsrc, wok, dst, kPieceBytes, kk, kin, k);
                if (parts & 2)
                    load_rows(kind, asrc, aok, dst + kSmallWPieces * kPieceBytes, kPieceBytes, kk,
                              kin, k);
            });
        };

        float acc[2][NT][4];
#pragma unroll
        for (uint32_t i = 0; i < 2; ++i)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        // The first item's w pieces of the prologue's stages are requested before pdl_wait (a
        // no-op unless this is a programmatic dependent launch): the weights do not depend on the
        // kernel before, a does. The first commit group then holds those w pieces too, which only
        // makes it wait longer.
        const bool first = item == block_rank();
        if (first) {
#pragma unroll 1
            for (uint32_t s = 0; s < kStages - 1; ++s)
                if (s < mine) load(s, s, 1);
            pdl_wait();
        }
        pipe.start([&](uint32_t stage, uint32_t i) { load(stage, i, first ? 2 : 3); });
        for (uint32_t i = 0; i < mine; ++i) {
            pipe.wait();  // this lane's copies of chunk i have landed
            // Refill the stage read in iteration i-1 (its values were consumed by that
            // iteration's mma, and only this lane ever touches its slots).
            pipe.refill(i, load);
            const uint32_t src = ring + pipe.stage(i) * kStageBytes;
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

}  // namespace gemm
