// Part of gemm.cu (included after its sizes): the tiled path, mma.sync m16n8k16 bf16 for m > 64.
//
// CTA tile BM x BN x 32, warps 2 (M) x 4 (N), 4-stage cp.async pipeline (one __syncthreads per
// k-tile), ldmatrix.x4 from an XOR-swizzled layout (16-byte chunk c of row r stored at chunk
// c ^ ((r >> 1) & 3): conflict-free for both the cp.async stores and the ldmatrix reads), grouped
// rasterization (kGroupM tile rows). Configs: L = 128x256 (warp tile 64x64, 96 KB), M = 128x128
// (64 KB), S = 64x64 (32 KB); gemm.cu's run_tiled takes the largest that the dynamic shared memory
// given holds, and the launcher chooses by shape (the largest config with >= 128 tiles and little
// padding, else S).
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_pipeline.cuh"

namespace gemm {

// A stage of the tiled path: 64-byte rows (k 32), 16-byte chunk ch of row r at ch ^ ((r >> 1) & 3).
// Rows r and r + 64 share the swizzle.
struct TiledLayout {
    enum : uint32_t { kRowBytes = kTileRowBytes };
    __device__ __forceinline__ static uint32_t offset(uint32_t r, uint32_t ch) {
        return r * kRowBytes + ((ch ^ ((r >> 1) & 3)) << 4);
    }
};

template <uint32_t BM, uint32_t BN, class Ep>
__device__ __forceinline__ void tiled_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                           uint32_t n, uint32_t k, const Ep& ep) {
    using Loader = TileLoader<BM, BN, TiledLayout>;
    constexpr uint32_t WM = BM / 2, WN = BN / 4;      // warp tile: warps 2 (M) x 4 (N)
    constexpr uint32_t MT = WM / 16, NT = WN / 8;     // mma tiles per warp
    static_assert(NT % 2 == 0, "tile config");
    static_assert(Loader::kK == kTileK, "a stage holds one k-tile");
    static_assert(kTileStages * Loader::kStageBytes == tile_smem_bytes<BM, BN>(),
                  "the loader's stages are the ones tile_smem_bytes counts");

    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t wm = warp >> 2, wn = warp & 3, g = lane >> 2, t = lane & 3;
    const bool fast = fast_loads(a, w, k);
    const bool vec = vector_stores(c, n);
    const uint32_t base = smem_u32(smem_raw);
    const auto slot = Loader::slot(tid);
    const uint32_t ktiles = ceil_div(k, kTileK);
    const uint64_t tiles_m = ceil_div(m, BM), tiles_n = ceil_div(n, BN);
    const uint64_t tiles = tiles_m * tiles_n;
    const CpAsyncRing<kTileStages, kTileStages - 1> pipe{ktiles};

    for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
        uint64_t tm, tn;
        grouped_tile(tile, tiles_m, tiles_n, tm, tn);
        const uint32_t m0 = static_cast<uint32_t>(tm) * BM, n0 = static_cast<uint32_t>(tn) * BN;
        const bf16* asrc[Loader::kALoads];
        bool aok[Loader::kALoads];
        row_sources(a, m0 + slot.row, Loader::kRowsPerPass, m, k, asrc, aok);
        const bf16* wsrc[Loader::kBLoads];
        bool wok[Loader::kBLoads];
        row_sources(w, n0 + slot.row, Loader::kRowsPerPass, n, k, wsrc, wok);
        const Loader load{asrc, aok, wsrc, wok, base, slot, k, fast};

        float acc[MT][NT][4];
#pragma unroll
        for (uint32_t i = 0; i < MT; ++i)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        pipe.start(load);
        for (uint32_t kt = 0; kt < ktiles; ++kt) {
            pipe.wait();        // this thread's copies of k-tile kt landed
            __syncthreads();    // ... and everyone's; stage kt-1 is free
            pipe.refill(kt, load);
            const uint32_t sa = base + pipe.stage(kt) * Loader::kStageBytes, sb = sa + Loader::kABytes;
#pragma unroll
            for (uint32_t ks = 0; ks < kTileK / 16; ++ks) {
                uint32_t af[MT][4], bfr[NT][2];
#pragma unroll
                for (uint32_t mt = 0; mt < MT; ++mt) {
                    // matrices: rows 0-7 / 8-15 of the m16 tile, k 0-7 / 8-15 -> a0, a1, a2, a3
                    const uint32_t r = wm * WM + mt * 16 + (lane & 15);
                    ldmatrix_x4(af[mt], sa + TiledLayout::offset(r, 2 * ks + (lane >> 4)));
                }
#pragma unroll
                for (uint32_t np = 0; np < NT / 2; ++np) {
                    // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                    const uint32_t r = wn * WN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
                    uint32_t q[4];
                    ldmatrix_x4(q, sb + TiledLayout::offset(r, 2 * ks + ((lane >> 3) & 1)));
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
            for (uint32_t nt = 0; nt < NT; ++nt)
                store_fragment(c, row, n0 + wn * WN + nt * 8 + 2 * t, m, n, acc[mt][nt], vec, e0, e8);
        }
    }
}

}  // namespace gemm
