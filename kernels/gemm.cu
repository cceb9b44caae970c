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
// Paths (256 threads = 8 warps each), one header each:
//   gemv    gemm_gemv.cuh: m <= 4 with fast loads and m * k <= 16384 (a decode step), 32 w rows
//           per CTA streamed through a 192 KB cp.async ring, CUDA-core fp32 dot products, a
//           butterfly sum per warp; 224 KB of shared memory (launched with less: small).
//   small   gemm_small.cuh: m <= 64 (decode), mma.sync with the K loop split across the warps
//           and a fixed-order reduction; 120 to 192 KB of shared memory.
//   fp8w    gemm_fp8w.cuh: m <= 64 over an e4m3 w with 32 x 32 e8m0 block scales, each weight
//           dequantised to bf16 in registers, k split in slabs over the CTAs (its own entry points).
//   tiled   gemm_tiled.cuh: mma.sync, CTA tiles L = 128x256, M = 128x128, S = 64x64 (96, 64,
//           32 KB).
//   wgmma   gemm_wgmma.cuh: sm_90a only, CTA tile 128x256 on two warpgroups (193 KB). Without
//           sm_90a features its entry points run the tiled path instead.
//   simt    gemm_simt.cuh: one output per thread, fp32 fma chain: the fallback, and a reference on
//           the device.
// Shared by the paths: gemm_common.cuh (launch geometry, PTX wrappers), gemm_pipeline.cuh (the
// operand loaders and the multi-stage cp.async ring every tensor-core path runs its K loop on),
// gemm_epilogue.cuh (the epilogues and the stores of c).
// This file: every size (layers/ops/gemm.py mirrors them; tests/test_gemm.py reads them here),
// which path a launch runs, and the entry points.
//
// Entry points (same signature):
//   dense_gemm_bf16_pipelined  the contract's kernel: gemv for m <= 4 when launched with its
//                              shared memory, small for m <= 64, else tiled (config from the
//                              dynamic shared memory, as dense_gemm_bf16_tiled);
//   dense_gemm_bf16_small_m    small path for any m (rows in blocks of 64);
//   dense_gemm_bf16_tiled      tiled path, config chosen by the dynamic shared memory given
//                              (>= 96 KB: L, >= 64 KB: M, >= 32 KB: S);
//   dense_gemm_bf16_wgmma      wgmma path (needs >= 197632 bytes of dynamic shared memory);
//   dense_gemm_bf16_simt       the scalar path.
//   dense_gemm_fp8w / _simt    the fp8-weight path (its own signature: w e4m3, ws its scales).
// Word-row entry points (the plain signature + const uint32_t* word_ids, const bf16* word [vocab,
// n] row-major, const bf16* const* word_over [m] (null, or per row an adapter's replacement word
// row, null where none), float scale; same launch plans as their plain twins):
//   dense_gemm_bf16_word       as dense_gemm_bf16_pipelined, with the word epilogue;
//   dense_gemm_bf16_word_small_m  as dense_gemm_bf16_small_m (any m: batch invariant);
//   dense_gemm_bf16_word_wgmma as dense_gemm_bf16_wgmma, with the word epilogue.
// Both may be launched as programmatic dependents of the gather that writes a and word_ids
// (they wait for it before reading either; the small path requests its first w stages first).
// word_ids are not bounds-checked here (the kernel is not told the vocabulary size): the caller
// guarantees word_ids[i] < vocab or word_ids[i] == kNoWord (that row is written as zeros).
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

// fp8-weight path (the small path's warps and w pieces)
constexpr uint32_t kFp8Block = 32;      // e8m0 scale block: 32 x 32 of w
constexpr uint32_t kFp8MaxRows = 64;    // rows of a a launch takes (8 n8 tiles)
constexpr uint32_t kFp8Chunk = 64;      // k per w stage: 16 per lane in each of the 4 lanes of a row
constexpr uint32_t kFp8Stages = 6;      // w ring depth per warp (2 KB stages)
constexpr uint32_t kFp8RingBytes = kWarps * kFp8Stages * kSmallWPieces * kPieceBytes;  // 96 KB
constexpr uint32_t kFp8MaxSlab = 8192;  // k a slab holds at most (256 scale blocks: 8 bytes a lane)

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
// ... with 128-column tiles (tma_store_n128: twice the tiles, for shapes whose last wave of
// 128x256 tiles leaves SMs idle): 32 KB stages, 5 of them, a 64 x 128 staging area per consumer
constexpr uint32_t kTmaN128 = 128;
constexpr uint32_t kTmaN128Stages = 5;
constexpr uint32_t kTmaN128Smem = kTmaN128Stages * (kWgBM + kTmaN128) * kWgBK * 2 + kTmaConsumers * 64 * kTmaN128 * 2 + 1024 + 16 * kTmaN128Stages;
// ... with 192-column tiles (tma_store_n192: three quarters of the work a tile, for shapes whose
// 128x256 tiles fill one wave only in part): 40 KB stages, 4 of them, a 64 x 192 staging area per consumer
constexpr uint32_t kTmaN192 = 192;
constexpr uint32_t kTmaN192Stages = 4;
constexpr uint32_t kTmaN192Smem = kTmaN192Stages * (kWgBM + kTmaN192) * kWgBK * 2 + kTmaConsumers * 64 * kTmaN192 * 2 + 1024 + 16 * kTmaN192Stages;

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

// The fp8-weight path's n8 tiles of a rows, a slab row's pitch in bytes (16 bytes of padding keep
// the lanes' reads conflict-free) and its shared memory: the w rings, then the slab of a.
__device__ __forceinline__ uint32_t fp8w_nt(uint32_t m) {
    return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;
}

__host__ __device__ constexpr uint32_t fp8w_pitch(uint32_t ks) { return ks * 2 + 16; }

__host__ __device__ constexpr uint32_t fp8w_smem(uint32_t nt, uint32_t ks) {
    return kFp8RingBytes + nt * 8 * fp8w_pitch(ks);
}

// The shared memory of the tiled path's config BM x BN.
template <uint32_t BM, uint32_t BN>
__host__ __device__ constexpr uint32_t tile_smem_bytes() {
    return kTileStages * (BM + BN) * kTileRowBytes;
}

}  // namespace gemm

#include "gemm_common.cuh"
#include "gemm_epilogue.cuh"
#include "gemm_simt.cuh"
#include "gemm_gemv.cuh"
#include "gemm_small.cuh"
#include "gemm_fp8w.cuh"
#include "gemm_tiled.cuh"
#include "gemm_wgmma.cuh"
#include "gemm_tma.cuh"
#include "gemm_tma_splitk.cuh"

namespace gemm {

// -- which path a launch runs ------------------------------------------------------------------
// gemv when the launch gives its shared memory and the operands suit it (it waits itself).
template <class Ep>
__device__ __forceinline__ bool run_gemv(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                         uint32_t n, uint32_t k, const Ep& ep) {
    if (m > kGemvMaxRows || static_cast<uint64_t>(m) * k > kGemvAElems || !fast_loads(a, w, k) ||
        !block_is_256() || dynamic_smem_bytes() < kGemvSmem)
        return false;
    switch (m) {
        case 1: gemv_gemm<1>(a, w, c, m, n, k, ep); break;
        case 2: gemv_gemm<2>(a, w, c, m, n, k, ep); break;
        default: gemv_gemm<4>(a, w, c, m, n, k, ep); break;
    }
    return true;
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

// The fp8-weight path when the launch and the operands fit it (m <= 64, a slab ks that is a
// multiple of 64 up to kFp8MaxSlab, a workspace where k takes several slabs, its shared memory).
__device__ __forceinline__ bool run_fp8w(const bf16* a, const uint8_t* w, const uint8_t* ws, bf16* c,
                                         uint32_t m, uint32_t n, uint32_t k, uint32_t ks, float* work,
                                         uint32_t* counters) {
    if (m > kFp8MaxRows || ks == 0 || ks % kFp8Chunk != 0 || ks > kFp8MaxSlab || !block_is_256()) return false;
    if (ks < k && (work == nullptr || counters == nullptr)) return false;
    const uint32_t nt = fp8w_nt(m);
    if (dynamic_smem_bytes() < fp8w_smem(nt, ks)) return false;
    switch (nt) {
        case 1: fp8w_gemm<1>(a, w, ws, c, m, n, k, ks, work, counters); break;
        case 2: fp8w_gemm<2>(a, w, ws, c, m, n, k, ks, work, counters); break;
        case 4: fp8w_gemm<4>(a, w, ws, c, m, n, k, ks, work, counters); break;
        default: fp8w_gemm<8>(a, w, ws, c, m, n, k, ks, work, counters); break;
    }
    return true;
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

// gemv where it fits, small for m <= 64, tiled above (config from the shared memory), simt if the
// launch fits none.
template <class Ep>
__device__ __forceinline__ void pipelined_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                               uint32_t n, uint32_t k, const Ep& ep) {
    if (run_gemv(a, w, c, m, n, k, ep)) return;
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

// The TMA paths on sm_90a builds when the launch fits the one chosen (384 threads and its shared
// memory), else simt (a and w come by pointer too, for it; the tiled path would need more than the
// 168 registers of a 384-thread CTA). kTmaLoadOnly / kTmaStoreC: tma_gemm with register or TMA
// stores (cmap is read only by the latter); kTmaStoreN128 / kTmaStoreN192: kTmaStoreC with 128- or
// 192-column tiles; kTmaSplitK: tma_splitk_gemm. kDependent (split-K only): a programmatic
// dependent launch that waits for the kernel before itself (pdl_wait), the split-K path once it
// has requested its first weight stages.
enum TmaPath : uint32_t { kTmaLoadOnly, kTmaStoreC, kTmaSplitK, kTmaStoreN128, kTmaStoreN192 };

template <uint32_t P, bool kDependent = false, class Ep>
__device__ __forceinline__ void tma_or_simt_gemm(const TensorMap& amap, const TensorMap& wmap,
                                                  const TensorMap& cmap, const bf16* a,
                                                  const bf16* w, bf16* c, uint32_t m, uint32_t n,
                                                  uint32_t k, const Ep& ep) {
    static_assert(!kDependent || P == kTmaSplitK, "only the split-K path waits itself");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kStore = P == kTmaStoreC || P == kTmaStoreN128 || P == kTmaStoreN192;
    constexpr uint32_t kBN = P == kTmaStoreN128 ? kTmaN128 : P == kTmaStoreN192 ? kTmaN192 : kWgBN;
    if (P == kTmaSplitK ? splitk_launch_fits() : tma_launch_fits<kStore, kBN>()) {
        if constexpr (P == kTmaSplitK) {
            tma_splitk_gemm<kDependent>(amap, wmap, c, m, n, k, ep);
        } else {
            tma_gemm<kStore, kBN>(amap, wmap, cmap, c, m, n, k, ep);
        }
        return;
    }
#endif
    if constexpr (kDependent) pdl_wait();
    gemm_simt(a, w, c, m, n, k, ep);
}

// The word entry points run after the n-gram gather that writes a and word_ids, and may be
// launched overlapping it (programmatic dependent launch): they wait for it (pdl_wait) before
// reading a or word_ids. The gemv, small and split-K paths request their first weight stages before
// waiting.
template <class Ep>
__device__ __forceinline__ void dependent_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                               uint32_t n, uint32_t k, const Ep& ep) {
    if (run_gemv(a, w, c, m, n, k, ep)) return;  // it waits itself
    if (m <= kSmallMaxRows && run_small(a, w, c, m, n, k, ep)) return;  // it waits itself
    pdl_wait();
    if (m <= kSmallMaxRows || !run_tiled(a, w, c, m, n, k, ep)) gemm_simt(a, w, c, m, n, k, ep);
}

}  // namespace gemm

// -- entry points -------------------------------------------------------------------------------
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

// The TMA path (sm_90a builds; 384 threads, kTmaSmem bytes): a_map and w_map are a and w as
// bf16 tensor maps (box 64 x 128 and 64 x 256, 128-byte swizzle; layers/ops/gemm.py builds them).
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_tma(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap w_map,
                    const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::tma_or_simt_gemm<gemm::kTmaLoadOnly>(a_map, w_map, a_map, a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// The TMA path with the TMA-store epilogue (384 threads, kTmaStoreSmem bytes): c_map is c as a
// bf16 tensor map of 64 x 64 boxes, 128-byte swizzle.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_tma_store(const __grid_constant__ TensorMap a_map,
                          const __grid_constant__ TensorMap w_map,
                          const __grid_constant__ TensorMap c_map, const bf16* a, const bf16* w,
                          bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::tma_or_simt_gemm<gemm::kTmaStoreC>(a_map, w_map, c_map, a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// dense_gemm_bf16_tma_store with 128x128 tiles (kTmaN128Smem bytes): w_map's box 64 x 128.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_tma_store_n128(const __grid_constant__ TensorMap a_map,
                               const __grid_constant__ TensorMap w_map,
                               const __grid_constant__ TensorMap c_map, const bf16* a, const bf16* w,
                               bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::tma_or_simt_gemm<gemm::kTmaStoreN128>(a_map, w_map, c_map, a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// dense_gemm_bf16_tma_store with 128x192 tiles (kTmaN192Smem bytes): w_map's box 64 x 192.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_tma_store_n192(const __grid_constant__ TensorMap a_map,
                               const __grid_constant__ TensorMap w_map,
                               const __grid_constant__ TensorMap c_map, const bf16* a, const bf16* w,
                               bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::tma_or_simt_gemm<gemm::kTmaStoreN192>(a_map, w_map, c_map, a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// The split-K TMA path (sm_90a builds; 384 threads, kSplitSmem bytes, a grid of whole clusters of
// kSplitK CTAs): a_map and w_map boxes 64 x 64.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SPLITK_CLUSTER __cluster_dims__(gemm::kSplitK, 1, 1)
#else
#define SPLITK_CLUSTER
#endif
extern "C" __global__ void SPLITK_CLUSTER __launch_bounds__(384, 1)
dense_gemm_bf16_tma_splitk(const __grid_constant__ TensorMap a_map,
                           const __grid_constant__ TensorMap w_map, const bf16* a, const bf16* w,
                           bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::tma_or_simt_gemm<gemm::kTmaSplitK>(a_map, w_map, a_map, a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// c = a @ W^T for an e4m3 w [n, k] with e8m0 32 x 32 block scales ws [ceil(n / 32), k / 32]
// (k % 32 == 0, w 16-byte aligned), W = bf16(f32(w) * 2^(ws - 127)), m <= 64: the fp8-weight path
// (gemm_fp8w.cuh) over k-slabs of ks (a multiple of 64, <= 8192; fp8w_smem(fp8w_nt(m), ks) bytes
// of shared memory). Where k takes more than one slab, work ([ceil(k / ks)][64][n] fp32) and
// counters ([ceil(n / 32)] u32, zero before the first launch; each launch leaves them zero) are
// this launch's alone. A launch that does not fit runs the scalar path. May be a programmatic
// dependent launch.
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_fp8w(const bf16* a, const uint8_t* w, const uint8_t* ws, bf16* c, uint32_t m, uint32_t n,
                uint32_t k, uint32_t ks, float* work, uint32_t* counters) {
    using namespace gemm;
    if (!run_fp8w(a, w, ws, c, m, n, k, ks, work, counters)) fp8w_simt(a, w, ws, c, m, n, k, PlainEpilogue{});
}

// dense_gemm_fp8w's scalar path, one output per thread, any launch shape.
extern "C" __global__ void
dense_gemm_fp8w_simt(const bf16* a, const uint8_t* w, const uint8_t* ws, bf16* c, uint32_t m,
                     uint32_t n, uint32_t k) {
    gemm::fp8w_simt(a, w, ws, c, m, n, k, gemm::PlainEpilogue{});
}

// One output per thread, any launch shape.
extern "C" __global__ void
dense_gemm_bf16_simt(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k) {
    gemm::gemm_simt(a, w, c, m, n, k, gemm::PlainEpilogue{});
}

// dense_gemm_bf16_pipelined with the word epilogue: c = bf16((a @ w^T + word row) * scale), the word
// row word_over[i] where given, else word[word_ids[i]].
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_word(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                     const uint32_t* word_ids, const bf16* word,
                     const bf16* const* word_over, float scale) {
    gemm::dependent_gemm(a, w, c, m, n, k, gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_small_m with the word epilogue, launched as dense_gemm_bf16_word is (a
// programmatic dependent of the gather): the small path for any m, so each row's sum is computed
// the same way whatever m is (batch invariance: the n-gram layers' batch_invariant mode).
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_word_small_m(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n,
                             uint32_t k, const uint32_t* word_ids, const bf16* word,
                             const bf16* const* word_over, float scale) {
    using namespace gemm;
    const WordEpilogue ep = word_epilogue(word_ids, word, word_over, n, scale);
    if (run_small(a, w, c, m, n, k, ep)) return;  // it waits itself
    pdl_wait();
    gemm_simt(a, w, c, m, n, k, ep);
}

// dense_gemm_bf16_wgmma with the word epilogue.
extern "C" __global__ void __launch_bounds__(256, 1)
dense_gemm_bf16_word_wgmma(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n,
                           uint32_t k, const uint32_t* word_ids, const bf16* word,
                           const bf16* const* word_over, float scale) {
    pdl_wait();
    gemm::wgmma_or_tiled_gemm(a, w, c, m, n, k, gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_tma with the word epilogue.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_word_tma(const __grid_constant__ TensorMap a_map,
                         const __grid_constant__ TensorMap w_map, const bf16* a, const bf16* w,
                         bf16* c, uint32_t m, uint32_t n, uint32_t k, const uint32_t* word_ids,
                         const bf16* word, const bf16* const* word_over, float scale) {
    pdl_wait();
    gemm::tma_or_simt_gemm<gemm::kTmaLoadOnly>(a_map, w_map, a_map, a, w, c, m, n, k,
                                  gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_tma_store with the word epilogue.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_word_tma_store(const __grid_constant__ TensorMap a_map,
                               const __grid_constant__ TensorMap w_map,
                               const __grid_constant__ TensorMap c_map, const bf16* a,
                               const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                               const uint32_t* word_ids, const bf16* word,
                               const bf16* const* word_over, float scale) {
    pdl_wait();
    gemm::tma_or_simt_gemm<gemm::kTmaStoreC>(a_map, w_map, c_map, a, w, c, m, n, k,
                                 gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_tma_store_n128 with the word epilogue.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_word_tma_store_n128(const __grid_constant__ TensorMap a_map,
                                    const __grid_constant__ TensorMap w_map,
                                    const __grid_constant__ TensorMap c_map, const bf16* a,
                                    const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                    const uint32_t* word_ids, const bf16* word,
                                    const bf16* const* word_over, float scale) {
    pdl_wait();
    gemm::tma_or_simt_gemm<gemm::kTmaStoreN128>(a_map, w_map, c_map, a, w, c, m, n, k,
                                    gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_tma_store_n192 with the word epilogue.
extern "C" __global__ void __launch_bounds__(384, 1)
dense_gemm_bf16_word_tma_store_n192(const __grid_constant__ TensorMap a_map,
                                    const __grid_constant__ TensorMap w_map,
                                    const __grid_constant__ TensorMap c_map, const bf16* a,
                                    const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                    const uint32_t* word_ids, const bf16* word,
                                    const bf16* const* word_over, float scale) {
    pdl_wait();
    gemm::tma_or_simt_gemm<gemm::kTmaStoreN192>(a_map, w_map, c_map, a, w, c, m, n, k,
                                    gemm::word_epilogue(word_ids, word, word_over, n, scale));
}

// dense_gemm_bf16_tma_splitk with the word epilogue.
extern "C" __global__ void SPLITK_CLUSTER __launch_bounds__(384, 1)
dense_gemm_bf16_word_tma_splitk(const __grid_constant__ TensorMap a_map,
                                const __grid_constant__ TensorMap w_map, const bf16* a,
                                const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                const uint32_t* word_ids, const bf16* word,
                                const bf16* const* word_over, float scale) {
    gemm::tma_or_simt_gemm<gemm::kTmaSplitK, true>(a_map, w_map, a_map, a, w, c, m, n, k,  // it waits itself
                                    gemm::word_epilogue(word_ids, word, word_over, n, scale));
}
