// Part of gemm.cu, and of ngram_decode.cu (its one-kernel decode step runs the gemv path): every
// size of the GEMM (layers/ops/gemm_plan.py mirrors them; tests/test_gemm.py reads them here), and
// the small helpers that derive shared-memory sizes from them.
#pragma once
#include "common.cuh"

namespace gemm {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;

// gemv path
constexpr uint32_t kGemvMaxRows = 4;    // rows of a it takes (NR = 1, 2 or 4 accumulators)
constexpr uint32_t kGemvCols = 32;      // w rows (columns of c) per work item: 4 per warp
constexpr uint32_t kGemvChunk = 256;    // k per stage: 8 per lane
constexpr uint32_t kGemvStages = 12;    // cp.async ring depth (16 KB stages)
constexpr uint32_t kGemvAElems = 16384; // m * k at most: a is staged whole in shared memory
constexpr uint32_t kGemvSmem = kGemvStages * kGemvCols * kGemvChunk * 2 + kGemvAElems * 2;

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

// wgmma path (sm_90a builds only: elsewhere nothing reads them)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr uint32_t kWgBM = 128;
constexpr uint32_t kWgBN = 256;
constexpr uint32_t kWgBK = 64;  // one 128-byte swizzle row
constexpr uint32_t kWgStages = 4;
constexpr uint32_t kWgStageBytes = (kWgBM + kWgBN) * kWgBK * 2;
constexpr uint32_t kWgSmem = kWgStages * kWgStageBytes + 1024;  // + alignment slack

// TMA path: the wgmma path's tile and stage, a producer and two consumer warpgroups
constexpr uint32_t kTmaThreads = 384;
constexpr uint32_t kTmaConsumers = 2;
constexpr uint32_t kTmaLoadStages = 4;
constexpr uint32_t kTmaSmem = kTmaLoadStages * kWgStageBytes + 1024 + 16 * kTmaLoadStages;  // + 2 mbarriers a stage
// ... with the TMA-store epilogue: 3 stages and a 64 x 256 bf16 staging area per consumer
constexpr uint32_t kTmaStoreStages = 3;
constexpr uint32_t kTmaStagingBytes = 64 * kWgBN * 2;
constexpr uint32_t kTmaStoreSmem = kTmaStoreStages * kWgStageBytes + kTmaConsumers * kTmaStagingBytes + 1024 + 16 * kTmaStoreStages;

// TMA split-K path (swap-AB): tiles of 64 w rows x 64 tokens (m <= 64) or 128 tokens (m > 64,
// so that w is read once for m <= 128); k split over a cluster of kSplitK CTAs and, inside a CTA,
// between its consumers (a stage holds one 64-wide k box of w and of a per consumer)
constexpr uint32_t kSplitK = 2;
constexpr uint32_t kSplitBN = 64;       // w rows (columns of c) per tile: one m64 wgmma
constexpr uint32_t kSplitBM = 64;       // tokens (rows of c) per tile for m <= kSplitBM ...
constexpr uint32_t kSplitWideBM = 128;  // ... and above
constexpr uint32_t kSplitBK = kTmaConsumers * kWgBK;  // k per stage
constexpr uint32_t kSplitShortK = 256;  // up to this k: no split over the cluster (one CTA, one tile)
constexpr uint32_t kSplitStages = 4;      // ring depth of the 64-token tiles (32 KB stages) ...
constexpr uint32_t kSplitWideStages = 3;  // ... and of the 128-token tiles (48 KB stages)
// Both tiles' shared memory: the ring, one fp32 partial tile per consumer (a token's 64 floats
// padded by 4), 2 mbarriers a stage. A launch gives the wide tile's, the larger.
constexpr uint32_t kSplitNarrowSmem = 1024 + kSplitStages * (kSplitBN + kSplitBM) * kSplitBK * 2 + kTmaConsumers * kSplitBM * (kSplitBN + 4) * 4 + 16 * kSplitStages;
constexpr uint32_t kSplitSmem = 1024 + kSplitWideStages * (kSplitBN + kSplitWideBM) * kSplitBK * 2 + kTmaConsumers * kSplitWideBM * (kSplitBN + 4) * 4 + 16 * kSplitWideStages;
#endif

// The small path's n8 tiles of a rows per work item, its ring depth and its shared memory.
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

// The shared memory of the tiled path's config BM x BN.
template <uint32_t BM, uint32_t BN>
__host__ __device__ constexpr uint32_t tile_smem_bytes() {
    return kTileStages * (BM + BN) * kTileRowBytes;
}

}  // namespace gemm
