// Part of gemm.cu (included after gemm_tma.cuh): the TMA split-K path for few rows of a (decode:
// m <= 64, and the skinny prefill shapes), sm_90a only.
//
// Swap-AB: the tokens are few, so w takes wgmma's M side (64 rows per consumer warpgroup, 128 per
// tile) and the tokens its N side (64 per tile, zero-filled by TMA past m): a tile is 128 columns
// of c by 64 rows of c. A tile of n = 4096 has only 32 such tiles, so each is split along k over a
// cluster of kSplitK CTAs (__cluster_dims__): CTA r of the cluster runs k-tiles r*q .. r*q+q-1.
// Per CTA: warpgroup 0's thread 0 loads, by TMA, a 128x64 box of w and a 64x64 box of a per k-tile
// into a ring of kSplitStages stages (full / empty mbarriers as in gemm_tma.cuh); warpgroups 1-2
// issue wgmma m64n64k16 and keep one group in flight. Then each consumer writes its fp32 partial
// tile to its own shared memory, the cluster synchronises (barrier.cluster, release / acquire),
// and CTA r sums the kSplitK partials of rows 32r .. 32r+31 of its tile (of w; columns of c) in
// rank order, reading its peers' shared memory (ld.shared::cluster), applies the epilogue and
// rounds once; a second cluster barrier keeps every partial alive until all its readers are done.
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

// Tiles are (128 columns of c) x (64 rows of c); cluster c_id takes tiles c_id, c_id + clusters, ...
template <class Ep>
__device__ __forceinline__ void tma_splitk_gemm(const TensorMap& amap, const TensorMap& wmap,
                                                bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                                const Ep& ep) {
    constexpr uint32_t kWBytes = kSplitBN * kWgBK * 2;  // the w box of a stage (a follows)
    const uint32_t tid = threadIdx.x, wg = tid / 128;
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t red = base + kSplitStages * kSplitStageBytes;  // [kSplitBN][kSplitRedStride] f32
    const uint32_t full = red + kSplitBN * kSplitRedStride * 4, empty = full + 8 * kSplitStages;
    init_ring(full, empty, kSplitStages);

    const uint32_t rank = cluster_rank();
    const uint32_t ktiles = ceil_div(k, kWgBK), per = ceil_div(ktiles, kSplitK);
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
                    tma_load_2d(sw, wmap, kt * kWgBK, n0, full + 8 * s);
                    tma_load_2d(sw + kWBytes, amap, kt * kWgBK, m0, full + 8 * s);
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
                const uint32_t sw = base + s * kSplitStageBytes + cw * 64 * WgmmaLayout::kRowBytes;
                const uint32_t sa = base + s * kSplitStageBytes + kWBytes;
                wgmma_k_tile(d, sw, sa);
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                wg_fence_operands(d);
                if (kt > kt0 && lane == 0) mbar_arrive(empty + 8 * ((i - 1) % kSplitStages));
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            wg_fence_operands(d);
            if (kt1 > kt0 && lane == 0) mbar_arrive(empty + 8 * ((it + kt1 - kt0 - 1) % kSplitStages));
            // d[4j + e]: w row 16*wq + g (+8 for e >= 2) of this warpgroup's 64, token 8j + 2t
            // (+1 for odd e): the partial of c[token, w row], stored [w row][token].
            const uint32_t row = cw * 64 + wq * 16 + g;
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

        // CTA `rank` finishes w rows 32*rank .. +31 of the tile: 16 row pairs x 64 tokens, one
        // pair (two adjacent columns of c) per thread and pass, tokens across adjacent threads.
        for (uint32_t p = tid; p < 16 * kSplitBM; p += kTmaThreads) {
            const uint32_t tok = p % kSplitBM, jr = 32 * rank + 2 * (p / kSplitBM);
            const uint32_t at = red + (jr * kSplitRedStride + tok) * 4;
            float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
            for (uint32_t r = 0; r < kSplitK; ++r) {
                const uint32_t peer = peer_smem(at, r);
                v0 += ld_cluster_f32(peer);
                v1 += ld_cluster_f32(peer + kSplitRedStride * 4);
            }
            const uint32_t crow = m0 + tok;
            if (crow < m) store_pair(c, crow, n0 + jr, n, v0, v1, vec, ep.row(crow, m));
        }
        cluster_sync();  // every peer done reading this CTA's partials
    }
}

}  // namespace gemm
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
