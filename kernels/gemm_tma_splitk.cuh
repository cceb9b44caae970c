// Part of gemm.cu (included after gemm_tma.cuh): the TMA split-K path for few rows of a (decode:
// m <= 64, and the skinny prefill shapes), sm_90a only.
//
// Swap-AB: the tokens are few, so w takes wgmma's M side (64 rows per tile, one m64 wgmma) and the
// tokens its N side (BM per tile, zero-filled by TMA past m): a tile is 64 columns of c by BM rows
// of c. BM is 64 for m <= 64 and 128 above (m64n128 wgmma, 3 stages), so w is read once for
// m <= 128 (64-token tiles read it twice, in two waves). n = 4096 has only 64 such tiles, so k is
// split twice: over a cluster of kSplitK CTAs (CTA r runs k-stages r*q .. r*q+q-1) and, inside
// each CTA, between its two consumer warpgroups (a stage holds two 64-wide k boxes of w and of a;
// consumer h takes box h). One CTA per SM and clusters of two: 64 tiles are 128 CTAs, one wave
// (four-CTA clusters of 128-row tiles measured 30 resident clusters for a 32-cluster launch, a
// second wave).
// Per CTA: warpgroup 0's thread 0 loads the stage's boxes by TMA into a ring (full / empty
// mbarriers as in gemm_tma.cuh); warpgroups 1-2 issue wgmma m64nBMk16 and
// keep one group in flight. Then each consumer writes its fp32 partial tile to its own block of
// shared memory, the cluster synchronises (barrier.cluster, release / acquire), and CTA r sums
// the kSplitK x 2 partials of w rows 32r .. 32r+31 of its tile (columns of c) in a fixed order,
// reading its peers' shared memory (ld.shared::cluster), applies the epilogue and rounds once; a
// second cluster barrier, relaxed, keeps every partial alive until all its readers are done (a
// reader's loads have returned before it arrives: their values are stored, and rows past m are not
// read; a release there would wait a MEMBAR.GPU for the stores of c, measured ~0.45 us a tile).
// For k <= kSplitShortK the cluster does not split k: each CTA takes 64-token tiles of its own and
// sums its two consumers' partials in its own shared memory, with CTA barriers.
// Deterministic (fixed summation order), no workspace, one rounding. Every thread of the CTA
// takes part in both cluster barriers of every tile, so clusters may loop over tiles.
#pragma once
#include "gemm_tma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace gemm {

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The cluster barrier without ordering memory: for readers whose loads have all returned.
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The address of shared-memory address `addr` of this CTA in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t peer_smem(uint32_t addr, uint32_t rank) {
    uint32_t out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}

__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

// The barrier between a tile's partials and their readers (the CTA's, or the cluster's) ...
template <uint32_t kRanks>
__device__ __forceinline__ void partials_written() {
    if constexpr (kRanks > 1) {
        cluster_sync();
    } else {
        __syncthreads();
    }
}

// ... and the one between the readers and the partials' next use (or the CTA's exit).
template <uint32_t kRanks>
__device__ __forceinline__ void partials_read() {
    if constexpr (kRanks > 1) {
        cluster_sync_relaxed();
    } else {
        __syncthreads();
    }
}

__device__ __forceinline__ float2 ld_cluster_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

// The split-K tile of BM tokens: its ring depth and the layout of its shared memory.
template <uint32_t BM>
struct SplitTile {
    static constexpr uint32_t kStages = BM == kSplitBM ? kSplitStages : kSplitWideStages;
    static constexpr uint32_t kWBox = kSplitBN * kWgBK * 2;  // a stage: a w box per consumer, ...
    static constexpr uint32_t kABox = BM * kWgBK * 2;        // ... then an a box (BM / 64 TMA boxes) per consumer
    static constexpr uint32_t kStageBytes = kTmaConsumers * (kWBox + kABox);
    static constexpr uint32_t kRedStride = kSplitBN + 4;  // floats per token of a partial tile
    static constexpr uint32_t kRedBytes = kTmaConsumers * BM * kRedStride * 4;
    static constexpr uint32_t kSmem = 1024 + kStages * kStageBytes + kRedBytes + 16 * kStages;
};
static_assert(SplitTile<kSplitBM>::kSmem == kSplitNarrowSmem && SplitTile<kSplitWideBM>::kSmem == kSplitSmem &&
              kSplitNarrowSmem <= kSplitSmem, "the launch's shared memory holds either tile");

__device__ __forceinline__ bool splitk_launch_fits() {
    return blockDim.x == kTmaThreads && blockDim.y == 1 && blockDim.z == 1 &&
           dynamic_smem_bytes() >= kSplitSmem;
}

// Tiles are (64 columns of c) x (BM rows of c). kRanks = kSplitK: k split over the cluster, cluster
// c_id takes tiles c_id, c_id + clusters, ...; kRanks = 1: each CTA takes tiles of its own (block
// b: b, b + blocks, ...), k split only between its consumers, summed in its own shared memory.
// kDependent: a programmatic dependent launch (the word GEMM after the n-gram gather), which waits
// for the kernel before itself: w does not depend on it, a and the epilogue's inputs do. Thread 0
// requests the w boxes of its first tile's first ring stages, then waits; every other thread waits
// at once (the consumers before they read anything, the epilogue's inputs included).
template <uint32_t BM, uint32_t kRanks, bool kDependent, class Ep>
__device__ __forceinline__ void tma_splitk_tiles(const TensorMap& amap, const TensorMap& wmap,
                                                 bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                                 const Ep& ep) {
    using T = SplitTile<BM>;
    static_assert(kSplitBN == 64 && kSplitBN % (2 * kRanks) == 0, "one m64 wgmma per tile, row pairs per CTA");
    static_assert(kRanks == 1 || kRanks == kSplitK, "k over the whole cluster or inside the CTA");
    static_assert(BM % 64 == 0, "a's boxes are 64 rows");
    constexpr uint32_t kWBox = T::kWBox, kABox = T::kABox, kStages = T::kStages;
    constexpr uint32_t kRows = kSplitBN / kRanks;  // w rows of a tile this CTA finishes
    const uint32_t tid = threadIdx.x, wg = tid / 128;
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t red = base + kStages * T::kStageBytes;  // [2][BM][kRedStride] f32
    const uint32_t full = red + T::kRedBytes, empty = full + 8 * kStages;
    init_ring(full, empty, kStages);

    const uint32_t rank = kRanks > 1 ? cluster_rank() : 0;
    const uint32_t ktiles = ceil_div(k, kSplitBK), per = ceil_div(ktiles, kRanks);
    const uint32_t kt0 = min(rank * per, ktiles), kt1 = min(kt0 + per, ktiles);
    const uint64_t tiles_n = ceil_div(n, kSplitBN), tiles = tiles_n * ceil_div(m, BM);
    const uint64_t groups = grid_blocks() / kRanks;  // CTAs (groups of kRanks) that share no tile
    const uint32_t lane = tid & 31, wq = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const bool vec = vector_stores(c, n);
    uint32_t it = 0;  // k-tiles through the ring so far, this CTA

    uint32_t early = 0;  // ring stages (of this CTA's first tile) whose w boxes went before pdl_wait
    if constexpr (kDependent) {
        const uint64_t tile = block_rank() / kRanks;
        if (tid == 0 && tile < tiles) {
            const uint32_t n0 = static_cast<uint32_t>(tile % tiles_n) * kSplitBN;
            early = min(kStages, kt1 - kt0);
            for (uint32_t s = 0; s < early; ++s) {  // fresh stages: no empty barrier to wait for
                mbar_expect_tx(full + 8 * s, T::kStageBytes);
#pragma unroll
                for (uint32_t h = 0; h < kTmaConsumers; ++h)
                    tma_load_2d(base + s * T::kStageBytes + h * kWBox, wmap, (kt0 + s) * kSplitBK + h * kWgBK,
                                n0, full + 8 * s);
            }
        }
        pdl_wait();
    }

    for (uint64_t tile = block_rank() / kRanks; tile < tiles; tile += groups) {
        const uint32_t n0 = static_cast<uint32_t>(tile % tiles_n) * kSplitBN;
        const uint32_t m0 = static_cast<uint32_t>(tile / tiles_n) * BM;
        if (wg == 0) {
            if (tid == 0) {
                for (uint32_t kt = kt0; kt < kt1; ++kt) {
                    const uint32_t i = it + kt - kt0, s = i % kStages;
                    const bool pre = i < early;  // its w boxes are on their way already
                    if (!pre) {
                        mbar_wait(empty + 8 * s, ((i / kStages) & 1) ^ 1);
                        mbar_expect_tx(full + 8 * s, T::kStageBytes);
                    }
                    const uint32_t sw = base + s * T::kStageBytes;
#pragma unroll
                    for (uint32_t h = 0; h < kTmaConsumers; ++h) {  // past k or m: zero-filled boxes
                        const uint32_t k0 = kt * kSplitBK + h * kWgBK;
                        if (!pre) tma_load_2d(sw + h * kWBox, wmap, k0, n0, full + 8 * s);
#pragma unroll
                        for (uint32_t q = 0; q < BM / 64; ++q)  // 64-row boxes, back to back: one N = BM operand
                            tma_load_2d(sw + kTmaConsumers * kWBox + h * kABox + q * 64 * WgmmaLayout::kRowBytes,
                                        amap, k0, m0 + 64 * q, full + 8 * s);
                    }
                }
            }
        } else {
            const uint32_t cw = wg - 1;
            float d[BM / 2];
#pragma unroll
            for (uint32_t i = 0; i < BM / 2; ++i) d[i] = 0.0f;
            for (uint32_t kt = kt0; kt < kt1; ++kt) {
                const uint32_t i = it + kt - kt0, s = i % kStages;
                mbar_wait(full + 8 * s, (i / kStages) & 1);
                const uint32_t sw = base + s * T::kStageBytes + cw * kWBox;
                const uint32_t sa = base + s * T::kStageBytes + kTmaConsumers * kWBox + cw * kABox;
                wgmma_k_tile(d, sw, sa);
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                wg_fence_operands(d);
                if (kt > kt0 && lane == 0) mbar_arrive(empty + 8 * ((i - 1) % kStages));
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            wg_fence_operands(d);
            if (kt1 > kt0 && lane == 0) mbar_arrive(empty + 8 * ((it + kt1 - kt0 - 1) % kStages));
            // d[4j + e]: w row 16*wq + g (+8 for e >= 2) of the tile, token 8j + 2t (+1 for odd
            // e): this consumer's partial of c[token, w row], stored [consumer][token][w row]
            // (rows of kRedStride floats: the warp's 32 stores of each fall in 32 banks).
            const uint32_t wrow = wq * 16 + g, part = red + cw * BM * T::kRedStride * 4;
#pragma unroll
            for (uint32_t j = 0; j < BM / 8; ++j) {
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) {
                    const uint32_t tok = 8 * j + 2 * t + (e & 1), col = wrow + 8 * (e >> 1);
                    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(part + (tok * T::kRedStride + col) * 4),
                                 "f"(d[4 * j + e]) : "memory");
                }
            }
        }
        it += kt1 - kt0;
        partials_written<kRanks>();

        // CTA `rank` finishes w rows kRows*rank .. +kRows-1 of the tile (columns of c) for its BM
        // tokens: one column pair per thread and pass, the pairs of a token across adjacent
        // threads (a warp stores two 64-byte row pieces of c); partials summed rank by rank,
        // consumer by consumer.
        for (uint32_t p = tid; p < kRows / 2 * BM; p += kTmaThreads) {
            const uint32_t tok = p / (kRows / 2), jr = kRows * rank + 2 * (p % (kRows / 2));
            const uint32_t crow = m0 + tok;
            if (crow >= m) continue;  // not read: every load below has returned before partials_read
            const uint32_t at = red + (tok * T::kRedStride + jr) * 4;
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (uint32_t r = 0; r < kRanks; ++r) {
#pragma unroll
                for (uint32_t h = 0; h < kTmaConsumers; ++h) {
                    const uint32_t own = at + h * BM * T::kRedStride * 4;
                    const float2 v = kRanks > 1 ? ld_cluster_f32x2(peer_smem(own, r)) : ld_shared_f32x2(own);
                    v0 += v.x;
                    v1 += v.y;
                }
            }
            store_pair(c, crow, n0 + jr, n, v0, v1, vec, ep.row(crow, m));
        }
        partials_read<kRanks>();
    }
}

// k <= kSplitShortK: 64-token tiles, one per CTA, k split only between the consumers (the cluster's
// barriers and remote reads cost more than a short k saves); else k split over the cluster, with
// 64-token tiles for m <= 64 and 128-token tiles above. The host plans the grid the same way.
template <bool kDependent, class Ep>
__device__ __forceinline__ void tma_splitk_gemm(const TensorMap& amap, const TensorMap& wmap,
                                                bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                                const Ep& ep) {
    if (threadIdx.x == 0) {  // the maps' descriptors on their way before the first TMA needs them
        asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(&amap)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
    }
    if (k <= kSplitShortK) {
        tma_splitk_tiles<kSplitBM, 1, kDependent>(amap, wmap, c, m, n, k, ep);
    } else if (m <= kSplitBM) {
        tma_splitk_tiles<kSplitBM, kSplitK, kDependent>(amap, wmap, c, m, n, k, ep);
    } else {
        tma_splitk_tiles<kSplitWideBM, kSplitK, kDependent>(amap, wmap, c, m, n, k, ep);
    }
}

}  // namespace gemm
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
