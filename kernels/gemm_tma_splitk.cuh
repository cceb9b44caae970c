// Part of gemm.cu (included after gemm_tma.cuh): the TMA split-K path for few rows of a (decode:
// m <= 64, and the skinny prefill shapes), sm_90a only.
//
// Swap-AB: the tokens are few, so w takes wgmma's M side (64 rows per tile, one m64 wgmma) and the
// tokens its N side (64 per tile, zero-filled by TMA past m): a tile is 64 columns of c by 64 rows
// of c. n = 4096 has only 64 such tiles, so k is split twice: over a cluster of kSplitK CTAs (CTA
// r runs k-stages r*q .. r*q+q-1) and, inside each CTA, between its two consumer warpgroups (a
// stage holds two 64-wide k boxes of w and of a; consumer h takes box h). One CTA per SM and
// clusters of two: 64 tiles are 128 CTAs, one wave (four-CTA clusters of 128-row tiles measured
// 30 resident clusters for a 32-cluster launch, a second wave).
// Per CTA: warpgroup 0's thread 0 loads the stage's four boxes by TMA into a ring of kSplitStages
// stages (full / empty mbarriers as in gemm_tma.cuh); warpgroups 1-2 issue wgmma m64n64k16 and
// keep one group in flight. Then each consumer writes its fp32 partial tile to its own block of
// shared memory, the cluster synchronises (barrier.cluster, release / acquire), and CTA r sums
// the kSplitK x 2 partials of w rows 32r .. 32r+31 of its tile (columns of c) in a fixed order,
// reading its peers' shared memory (ld.shared::cluster), applies the epilogue and rounds once; a
// second cluster barrier keeps every partial alive until all its readers are done.
// Deterministic (fixed summation order), no workspace, one rounding. Every thread of the CTA
// takes part in both cluster barriers of every tile, so clusters may loop over tiles.
#pragma once
#include "gemm_tma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace gemm {

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
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

__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ bool splitk_launch_fits() {
    return blockDim.x == kTmaThreads && blockDim.y == 1 && blockDim.z == 1 &&
           dynamic_smem_bytes() >= kSplitSmem;
}

// Tiles are (64 columns of c) x (64 rows of c); cluster c_id takes tiles c_id, c_id + clusters, ...
template <class Ep>
__device__ __forceinline__ void tma_splitk_gemm(const TensorMap& amap, const TensorMap& wmap,
                                                bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                                const Ep& ep) {
    static_assert(kSplitBN == 64 && kSplitBN % (2 * kSplitK) == 0, "one m64 wgmma per tile, row pairs per CTA");
    constexpr uint32_t kWBox = kSplitBN * kWgBK * 2, kABox = kSplitBM * kWgBK * 2;  // a stage: w boxes, then a boxes
    constexpr uint32_t kRows = kSplitBN / kSplitK;  // w rows of a tile this CTA finishes
    const uint32_t tid = threadIdx.x, wg = tid / 128;
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t red = base + kSplitStages * kSplitStageBytes;  // [2][kSplitBN][kSplitRedStride] f32
    const uint32_t full = red + kSplitRedBytes, empty = full + 8 * kSplitStages;
    init_ring(full, empty, kSplitStages);

    const uint32_t rank = cluster_rank();
    const uint32_t ktiles = ceil_div(k, kSplitBK), per = ceil_div(ktiles, kSplitK);
    const uint32_t kt0 = min(rank * per, ktiles), kt1 = min(kt0 + per, ktiles);
    const uint64_t tiles_n = ceil_div(n, kSplitBN), tiles = tiles_n * ceil_div(m, kSplitBM);
    const uint64_t clusters = grid_blocks() / kSplitK;
    const uint32_t lane = tid & 31, wq = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const bool vec = vector_stores(c, n);
    uint32_t it = 0;  // k-tiles through the ring so far, this CTA

    for (uint64_t tile = block_rank() / kSplitK; tile < tiles; tile += clusters) {
        const uint32_t n0 = static_cast<uint32_t>(tile % tiles_n) * kSplitBN;
        const uint32_t m0 = static_cast<uint32_t>(tile / tiles_n) * kSplitBM;
        if (wg == 0) {
            if (tid == 0) {
                for (uint32_t kt = kt0; kt < kt1; ++kt) {
                    const uint32_t s = (it + kt - kt0) % kSplitStages;
                    const uint32_t use = (it + kt - kt0) / kSplitStages;
                    mbar_wait(empty + 8 * s, (use & 1) ^ 1);
                    mbar_expect_tx(full + 8 * s, kSplitStageBytes);
                    const uint32_t sw = base + s * kSplitStageBytes;
#pragma unroll
                    for (uint32_t h = 0; h < kTmaConsumers; ++h) {  // past k: zero-filled boxes
                        const uint32_t k0 = kt * kSplitBK + h * kWgBK;
                        tma_load_2d(sw + h * kWBox, wmap, k0, n0, full + 8 * s);
                        tma_load_2d(sw + kTmaConsumers * kWBox + h * kABox, amap, k0, m0, full + 8 * s);
                    }
                }
            }
        } else {
            const uint32_t cw = wg - 1;
            float d[32];
#pragma unroll
            for (uint32_t i = 0; i < 32; ++i) d[i] = 0.0f;
            for (uint32_t kt = kt0; kt < kt1; ++kt) {
                const uint32_t i = it + kt - kt0, s = i % kSplitStages;
                mbar_wait(full + 8 * s, (i / kSplitStages) & 1);
                const uint32_t sw = base + s * kSplitStageBytes + cw * kWBox;
                const uint32_t sa = base + s * kSplitStageBytes + kTmaConsumers * kWBox + cw * kABox;
                wgmma_k_tile(d, sw, sa);
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                wg_fence_operands(d);
                if (kt > kt0 && lane == 0) mbar_arrive(empty + 8 * ((i - 1) % kSplitStages));
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            wg_fence_operands(d);
            if (kt1 > kt0 && lane == 0) mbar_arrive(empty + 8 * ((it + kt1 - kt0 - 1) % kSplitStages));
            // d[4j + e]: w row 16*wq + g (+8 for e >= 2) of the tile, token 8j + 2t (+1 for odd
            // e): this consumer's partial of c[token, w row], stored [consumer][w row][token].
            const uint32_t row = cw * kSplitBN + wq * 16 + g;
#pragma unroll
            for (uint32_t j = 0; j < 8; ++j) {
                const uint32_t col = 8 * j + 2 * t;
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                             :: "r"(red + (row * kSplitRedStride + col) * 4), "f"(d[4 * j]), "f"(d[4 * j + 1])
                             : "memory");
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                             :: "r"(red + ((row + 8) * kSplitRedStride + col) * 4), "f"(d[4 * j + 2]),
                                "f"(d[4 * j + 3])
                             : "memory");
            }
        }
        it += kt1 - kt0;
        cluster_sync();  // every partial of this tile written, cluster-wide

        // CTA `rank` finishes w rows kRows*rank .. +kRows-1 of the tile: row pairs x 64 tokens, one
        // pair (two adjacent columns of c) per thread and pass, tokens across adjacent threads;
        // partials summed rank by rank, consumer by consumer.
        for (uint32_t p = tid; p < kRows / 2 * kSplitBM; p += kTmaThreads) {
            const uint32_t tok = p % kSplitBM, jr = kRows * rank + 2 * (p / kSplitBM);
            const uint32_t at = red + (jr * kSplitRedStride + tok) * 4;
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (uint32_t r = 0; r < kSplitK; ++r) {
#pragma unroll
                for (uint32_t h = 0; h < kTmaConsumers; ++h) {
                    const uint32_t peer = peer_smem(at + h * kSplitBN * kSplitRedStride * 4, r);
                    v0 += ld_cluster_f32(peer);
                    v1 += ld_cluster_f32(peer + kSplitRedStride * 4);
                }
            }
            const uint32_t crow = m0 + tok;
            if (crow < m) store_pair(c, crow, n0 + jr, n, v0, v1, vec, ep.row(crow, m));
        }
        cluster_sync();  // every peer done reading this CTA's partials
    }
}

}  // namespace gemm
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
