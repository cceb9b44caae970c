// Part of gemm.cu (included after its sizes): the gemv path, for m <= kGemvMaxRows (a decode
// step's one to four rows), bound by reading w once.
//
// A work item is kGemvCols rows of w (columns of c), four per warp. The K loop runs over chunks of
// kGemvChunk k: lane l of a warp copies, for each of its warp's four w rows, the 16 bytes at
// k = chunk * kGemvChunk + 8l .. +7 (a warp instruction reads 512 contiguous bytes of one row)
// into a cp.async ring of kGemvStages chunks, and later reads back exactly those bytes itself: no
// barrier in the K loop. The ring is deep (192 KB) so that the first item's prologue, requested
// before pdl_wait, streams about 70 % of a 32-row slice of w while the kernel before (the n-gram
// gather) still runs. a (m x k, at most kGemvAElems) is then staged whole in shared memory.
// Each lane accumulates 8 products per chunk per (w row, a row) in fp32 with fmaf, in k order;
// the warp sums its lanes by a butterfly (every lane ends with the same bits); one rounding.
// A row's sum does not depend on the other rows of a: the path is batch invariant within itself.
#pragma once
#include "gemm_epilogue.cuh"

namespace gemm {

// acc += the 8 products of 8 bf16 of w and of a (bf16 -> fp32 is exact: a shift).
__device__ __forceinline__ void dot8(float& acc, const uint4& w, const uint4& a) {
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(wv[i] << 16), __uint_as_float(av[i] << 16), acc);
        acc = fmaf(__uint_as_float(wv[i] & 0xffff0000u), __uint_as_float(av[i] & 0xffff0000u), acc);
    }
}

template <uint32_t NR, class Ep>
__device__ __forceinline__ void gemv_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                          uint32_t n, uint32_t k, const Ep& ep) {
    constexpr uint32_t kRows = kGemvCols / kWarps;  // w rows per warp
    constexpr uint32_t kSlotBytes = 32 * 16;        // one w row of a chunk: 16 bytes per lane
    constexpr uint32_t kStageBytes = kGemvCols * kSlotBytes;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t chunks = ceil_div(k, kGemvChunk);
    const uint32_t ring = smem_u32(smem_raw) + warp * kRows * kSlotBytes + lane * 16;
    const uint32_t a_sh = smem_u32(smem_raw) + kGemvStages * kStageBytes;
    const bool vec = vector_stores(c, n);
    const uint64_t items = ceil_div(n, kGemvCols);
    bool first = true;

    for (uint64_t item = block_rank(); item < items; item += grid_blocks()) {
        const uint32_t row0 = static_cast<uint32_t>(item) * kGemvCols + warp * kRows;  // w rows
        const bf16* src[kRows];
        bool ok[kRows];
#pragma unroll
        for (uint32_t r = 0; r < kRows; ++r) {
            ok[r] = row0 + r < n;
            src[r] = w + static_cast<uint64_t>(ok[r] ? row0 + r : 0) * k + 8 * lane;
        }
        // Chunk i into stage i % kGemvStages, one commit group per chunk (empty past the end).
        auto load = [&](uint32_t i) {
            const uint32_t kk = i * kGemvChunk + 8 * lane;
            if (i < chunks) {
                const uint32_t dst = ring + (i % kGemvStages) * kStageBytes;
                const bool kin = kk < k;
#pragma unroll
                for (uint32_t r = 0; r < kRows; ++r)
                    cp_async16(dst + r * kSlotBytes, kin && ok[r] ? src[r] + i * kGemvChunk : w,
                               kin && ok[r] ? 16u : 0u);
            }
            cp_async_commit();
        };
#pragma unroll 1
        for (uint32_t i = 0; i + 1 < kGemvStages; ++i) load(i);
        if (first) {  // w does not depend on the kernel before; a does
            pdl_wait();
            const uint32_t vecs = m * k / 8;  // fast loads: k % 8 == 0, a 16-byte aligned
            for (uint32_t v = threadIdx.x; v < vecs; v += kThreads)
                st_shared16(a_sh + 16 * v, __ldg(reinterpret_cast<const uint4*>(a) + v));
            __syncthreads();
            first = false;
        }

        float acc[kRows][NR];
#pragma unroll
        for (uint32_t r = 0; r < kRows; ++r)
#pragma unroll
            for (uint32_t j = 0; j < NR; ++j) acc[r][j] = 0.0f;
        for (uint32_t i = 0; i < chunks; ++i) {
            cp_async_wait<kGemvStages - 2>();  // this lane's copies of chunk i have landed
            load(i + kGemvStages - 1);         // into the stage read in iteration i - 1
            const uint32_t kk = i * kGemvChunk + 8 * lane;
            if (kk >= k) continue;
            const uint32_t stage = ring + (i % kGemvStages) * kStageBytes;
            uint4 av[NR];
#pragma unroll
            for (uint32_t j = 0; j < NR; ++j)  // rows past m repeat the last (never stored)
                av[j] = ld_shared16(a_sh + 2 * ((j < m ? j : m - 1) * k + kk));
#pragma unroll
            for (uint32_t r = 0; r < kRows; ++r) {
                const uint4 wv = ld_shared16(stage + r * kSlotBytes);
#pragma unroll
                for (uint32_t j = 0; j < NR; ++j) dot8(acc[r][j], wv, av[j]);
            }
        }
        cp_async_wait<0>();

#pragma unroll
        for (uint32_t r = 0; r < kRows; ++r)
#pragma unroll
            for (uint32_t j = 0; j < NR; ++j)
#pragma unroll
                for (uint32_t s = 16; s > 0; s >>= 1) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], s);
        // Lane 2j + p stores row j's columns row0 + 2p, + 1 (w rows 2p, 2p + 1 of this warp).
#pragma unroll
        for (uint32_t j = 0; j < NR; ++j)
#pragma unroll
            for (uint32_t p = 0; p < kRows / 2; ++p)
                if (lane == 2 * j + p && j < m)
                    store_pair(c, j, row0 + 2 * p, n, acc[2 * p][j], acc[2 * p + 1][j], vec, ep.row(j, m));
    }
}

}  // namespace gemm
