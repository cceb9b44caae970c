// Part of gemm.cu (included after its sizes): the TMA path, sm_90a only (elsewhere its entry points
// run the tiled path).
//
// Warp-specialised and persistent: 3 warpgroups (384 threads), one CTA per SM, each CTA walking
// the 128x256 output tiles grid-stride in grouped order (grouped_tile).
//   producer   warpgroup 0 gives its registers back (setmaxnreg 40) and one thread issues the
//              TMA loads: per k-tile one 128x64 box of a and one 256x64 box of w (128-byte
//              swizzle, zero-filled past m, n and k by the TMA unit) into a ring of kTmaStages
//              stages, each stage with a "full" mbarrier (expect_tx of the stage's bytes) and an
//              "empty" one. It runs ahead across tiles: while the consumers store one tile's
//              results it is already loading the next tile's first stages.
//   consumers  warpgroups 1 and 2 (setmaxnreg 232) each own 64 rows of the tile: per k-tile they
//              wait on the stage's full barrier, issue 4 wgmma m64n256k16 from shared memory (the
//              wgmma path's descriptors: the TMA swizzle is WgmmaLayout), keep one wgmma group in
//              flight and release the stage before it (each warp's lane 0 arrives on its empty
//              barrier once wgmma.wait_group says the group that read it retired). Then they
//              store their 64x256 fp32 accumulators through the epilogue (store_fragment), as
//              the wgmma path does, or with TMA stores (store_tile_tma), the epilogue's operands
//              then staged in shared memory during the main loop (stage_operands).
// dense_gemm_bf16_tma_store_n128 and _n192 run the same with 128x128 and 128x192 tiles (wgmma
// m64n128k16 / m64n192k16, a 128x64 / 192x64 box of w, kTmaN128Stages / kTmaN192Stages stages):
// more tiles of less work, for shapes whose last wave of 128x256 tiles would leave SMs idle
// (layers/ops/gemm_plan.py, tma_store_width).
// Mbarrier phases: the n-th use of stage s (n = it / kTmaStages over the CTA's whole k-tile
// sequence) waits for full-phase parity n & 1; the producer waits for empty-phase parity
// (n & 1) ^ 1, which a fresh barrier already satisfies for n = 0.
// The tensor maps (a: [m, k], w: [n, k], box 64 x 128 and 64 x 256, bf16, SWIZZLE_128B) are built
// by the host (layers/ops/gemm.py) and passed by value as __grid_constant__ parameters; reads are
// bounded by the maps' own extents whatever m, n, k say, and writes of c by m and n.
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_wgmma.cuh"

// A CUtensorMap (cuda.h's 128-byte, 64-byte-aligned opaque type), by value.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace gemm {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// One box of a 2-D tensor map into shared memory at dst; coordinates innermost first (k, row).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TensorMap& map, uint32_t x,
                                            uint32_t y, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n"
        :: "r"(dst), "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(bar) : "memory");
}

// One box from shared memory at src to a 2-D tensor map (bulk async group; clipped at the edges).
__device__ __forceinline__ void tma_store_2d(const TensorMap& map, uint32_t src, uint32_t x, uint32_t y) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 :: "l"(reinterpret_cast<uint64_t>(&map)), "r"(x), "r"(y), "r"(src) : "memory");
}

// Named barrier `id` (1 + consumer warpgroup) over that warpgroup's 128 threads.
__device__ __forceinline__ void warpgroup_bar(uint32_t id) {
    asm volatile("bar.sync %0, 128;\n" :: "r"(id) : "memory");
}

template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(R));
}

template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(R));
}

// A ring's mbarriers, 8 bytes each: full[s] takes one arrival (the producer's expect_tx, then the
// TMA bytes), empty[s] one from lane 0 of every consumer warp; initialised by thread 0 and made
// visible before any thread uses them.
__device__ __forceinline__ void init_ring(uint32_t full, uint32_t empty, uint32_t stages) {
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < stages; ++s) {
            mbar_init(full + 8 * s, 1);
            mbar_init(empty + 8 * s, kTmaConsumers * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}

// A TMA path's ring depth and launch shared memory, by epilogue (kStore: TMA stores) and tile
// width BN: kWgBN, or with kStore kTmaN128 / kTmaN192.
template <bool kStore, uint32_t BN>
struct TmaTile {
    static_assert(BN == kWgBN || (kStore && (BN == kTmaN128 || BN == kTmaN192)), "the TMA path's tiles");
    static constexpr uint32_t kStages = BN == kTmaN128   ? kTmaN128Stages
                                        : BN == kTmaN192 ? kTmaN192Stages
                                        : kStore         ? kTmaStoreStages
                                                         : kTmaLoadStages;
    static constexpr uint32_t kSmem = BN == kTmaN128   ? kTmaN128Smem
                                      : BN == kTmaN192 ? kTmaN192Smem
                                      : kStore         ? kTmaStoreSmem
                                                       : kTmaSmem;
};

template <bool kStore, uint32_t BN>
__device__ __forceinline__ bool tma_launch_fits() {
    return blockDim.x == kTmaThreads && blockDim.y == 1 && blockDim.z == 1 &&
           dynamic_smem_bytes() >= TmaTile<kStore, BN>::kSmem;
}

// The TMA-store epilogue. Each consumer owns a 64 x BN staging area: BN / 64 boxes of 64 x 64, 128-byte
// rows, 16-byte chunk ch of row r at ch ^ (r & 7) (the SWIZZLE_128B layout of c_map, and
// conflict-free for the fragment's writes). Thread (wq, g, t) owns rows r = 16 wq + g and r + 8,
// and in each 16-byte chunk (column group j = 8 box + ch) the 4 bytes at 4t: columns 8j + 2t, +1.
//
// stage_operands, early in a tile's main loop: once the previous tile's TMA store has read the
// staging area (bulk wait_group.read), the rows' epilogue operands (word rows) are copied into it
// with cp.async, each 16-byte chunk at the place where its results will go. Thread t copies chunks
// j = t, t + 4, ... of its two rows; where a row cannot be staged (not 16-byte aligned, or a chunk
// crossing n) its pairs are loaded when applied. The epilogue then costs no memory round trip per
// column group (read one at a time behind the st.shared, 32 of them a tile: NOTES-gemm.md).
// The staging area's 16-byte chunk of column group j (8 a 64-wide box) in row r.
__device__ __forceinline__ uint32_t staging_chunk(uint32_t stage, uint32_t r, uint32_t j) {
    return stage + (j / 8) * 8192 + r * 128 + (((j % 8) ^ (r & 7)) << 4);
}

template <uint32_t BN, class Row>
__device__ __forceinline__ void stage_operands(uint32_t stage, uint32_t n0, uint32_t n, uint32_t cw,
                                               const Row& e0, const Row& e8) {
    const uint32_t tid = threadIdx.x & 127, lane = tid & 31, wq = tid >> 5, g = lane >> 2, t = lane & 3;
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    warpgroup_bar(1 + cw);
    const uint32_t r = wq * 16 + g;
    const bool s0 = e0.staged(n0), s8 = e8.staged(n0);
#pragma unroll
    for (uint32_t j = t; j < BN / 8; j += 4) {
        const uint32_t col = n0 + 8 * j;
        if (col + 8 > n) continue;
        if (s0) cp_async16(staging_chunk(stage, r, j), e0.src(col), 16);
        if (s8) cp_async16(staging_chunk(stage, r + 8, j), e8.src(col), 16);
    }
    cp_async_commit();
}

// (v0, v1) at column col through row e: its operand pair read back from the staging area at
// addr where it was staged, else loaded now.
template <class Row>
__device__ __forceinline__ void apply_pair(const Row& e, bool staged, uint32_t addr, uint32_t col,
                                           float& v0, float& v1) {
    if (staged) {
        uint32_t bits;
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bits) : "r"(addr) : "memory");
        e.apply2(v0, v1, bits);
    } else {
        e.apply2(col, v0, v1);
    }
}

// A consumer's 64 x BN results, through e0 / e8 (staged by stage_operands, or loaded here) and
// rounded, into its staging area, then stored by one thread with TMA (clipped at m and n).
template <uint32_t BN, class Row>
__device__ __forceinline__ void store_tile_tma(const TensorMap& cmap, uint32_t stage, const float* d,
                                               uint32_t row0, uint32_t n0, uint32_t n, uint32_t cw,
                                               const Row& e0, const Row& e8) {
    const uint32_t tid = threadIdx.x & 127, lane = tid & 31, wq = tid >> 5, g = lane >> 2, t = lane & 3;
    cp_async_wait<0>();
    warpgroup_bar(1 + cw);  // every thread's chunks have landed
    const uint32_t r = wq * 16 + g;  // row of the consumer's 64 (and r + 8)
    const bool s0 = e0.staged(n0), s8 = e8.staged(n0);
#pragma unroll
    for (uint32_t j = 0; j < BN / 8; ++j) {
        const uint32_t col = n0 + 8 * j + 2 * t;
        const uint32_t a0 = staging_chunk(stage, r, j) + 4 * t, a8 = staging_chunk(stage, r + 8, j) + 4 * t;
        const bool whole = n0 + 8 * j + 8 <= n;  // the chunk was staged (for a staged row)
        float v[4] = {d[4 * j], d[4 * j + 1], d[4 * j + 2], d[4 * j + 3]};
        if (col < n) {  // past n the word row must not be read; TMA drops those columns
            apply_pair(e0, s0 && whole, a0, col, v[0], v[1]);
            apply_pair(e8, s8 && whole, a8, col, v[2], v[3]);
        }
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(a0), "r"(*reinterpret_cast<const uint32_t*>(&lo)) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(a8), "r"(*reinterpret_cast<const uint32_t*>(&hi)) : "memory");
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the TMA unit
    warpgroup_bar(1 + cw);
    if (tid == 0) {
#pragma unroll
        for (uint32_t b = 0; b < BN / 64; ++b) tma_store_2d(cmap, stage + b * 8192, n0 + 64 * b, row0);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
}

// kStore: the TMA-store epilogue (cmap); else register stores to c. BN: the tile's columns,
// kWgBN (wgmma m64n256k16), or with kStore kTmaN128 (m64n128k16) or kTmaN192 (m64n192k16);
// w_map's box BN rows. The ring's stages: TmaTile.
template <bool kStore, uint32_t BN, class Ep>
__device__ __forceinline__ void tma_gemm(const TensorMap& amap, const TensorMap& wmap,
                                         const TensorMap& cmap, bf16* c, uint32_t m, uint32_t n,
                                         uint32_t k, const Ep& ep) {
    constexpr uint32_t kABytes = kWgBM * kWgBK * 2;
    constexpr uint32_t kStageBytes = (kWgBM + BN) * kWgBK * 2;
    constexpr uint32_t kStagingBytes = 64 * BN * 2;  // a consumer's, kStore only
    constexpr uint32_t kTmaStages = TmaTile<kStore, BN>::kStages;
    const uint32_t tid = threadIdx.x, wg = tid / 128;
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t staging = base + kTmaStages * kStageBytes;
    const uint32_t full = staging + (kStore ? kTmaConsumers * kStagingBytes : 0);
    const uint32_t empty = full + 8 * kTmaStages;
    init_ring(full, empty, kTmaStages);

    const uint32_t ktiles = ceil_div(k, kWgBK);
    const uint64_t tiles_m = ceil_div(m, kWgBM), tiles_n = ceil_div(n, BN);
    const uint64_t tiles = tiles_m * tiles_n;

    if (wg == 0) {  // producer
        setmaxnreg_dec<40>();
        if (tid != 0) return;
        asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(&amap)) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<uint64_t>(&wmap)) : "memory");
        uint32_t it = 0;
        for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
            uint64_t tm, tn;
            grouped_tile(tile, tiles_m, tiles_n, tm, tn);
            const uint32_t m0 = static_cast<uint32_t>(tm) * kWgBM, n0 = static_cast<uint32_t>(tn) * BN;
            for (uint32_t kt = 0; kt < ktiles; ++kt, ++it) {
                const uint32_t s = it % kTmaStages, use = it / kTmaStages;
                mbar_wait(empty + 8 * s, (use & 1) ^ 1);
                mbar_expect_tx(full + 8 * s, kStageBytes);
                const uint32_t sa = base + s * kStageBytes;
                tma_load_2d(sa, amap, kt * kWgBK, m0, full + 8 * s);
                tma_load_2d(sa + kABytes, wmap, kt * kWgBK, n0, full + 8 * s);
            }
        }
        return;
    }

    setmaxnreg_inc<232>();
    const uint32_t cw = wg - 1, lane = tid & 31, wq = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const bool vec = vector_stores(c, n);
    uint32_t it = 0;
    for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
        uint64_t tm, tn;
        grouped_tile(tile, tiles_m, tiles_n, tm, tn);
        const uint32_t m0 = static_cast<uint32_t>(tm) * kWgBM, n0 = static_cast<uint32_t>(tn) * BN;
        // d[4j + e]: row 16*wq + g (+8 for e >= 2), column 8j + 2t (+1 for odd e).
        const uint32_t row = m0 + cw * 64 + wq * 16 + g;
        const auto e0 = ep.row(row, m), e8 = ep.row(row + 8, m);
        const uint32_t stage_at = ktiles > 1 ? 1 : 0;  // behind a k-tile's wgmma, once e0 / e8 are known
        float d[BN / 2];
#pragma unroll
        for (uint32_t i = 0; i < BN / 2; ++i) d[i] = 0.0f;

        for (uint32_t kt = 0; kt < ktiles; ++kt, ++it) {
            const uint32_t s = it % kTmaStages;
            mbar_wait(full + 8 * s, (it / kTmaStages) & 1);
            const uint32_t sa = base + s * kStageBytes;
            const uint32_t sa_wg = sa + cw * 64 * WgmmaLayout::kRowBytes, sb = sa + kABytes;
            wgmma_k_tile(d, sa_wg, sb);
            if constexpr (kStore) {
                if (kt == stage_at) stage_operands<BN>(staging + cw * kStagingBytes, n0, n, cw, e0, e8);
            }
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            wg_fence_operands(d);
            // the group of the previous k-tile retired: its stage may be refilled
            if (kt > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % kTmaStages));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_fence_operands(d);
        if (ktiles > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % kTmaStages));

        if constexpr (kStore) {
            if (ktiles == 0) stage_operands<BN>(staging + cw * kStagingBytes, n0, n, cw, e0, e8);
            store_tile_tma<BN>(cmap, staging + cw * kStagingBytes, d, m0 + cw * 64, n0, n, cw, e0, e8);
        } else {
#pragma unroll
            for (uint32_t j = 0; j < BN / 8; ++j)
                store_fragment(c, row, n0 + 8 * j + 2 * t, m, n, d + 4 * j, vec, e0, e8);
        }
    }
    if constexpr (kStore) {
        if ((tid & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
}

}  // namespace gemm
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
