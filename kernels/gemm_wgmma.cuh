// Part of gemm.cu (included after its sizes): the wgmma path, sm_90a only (elsewhere gemm.cu's
// entry points run the tiled path instead).
//
// CTA tile 128x256x64, two warpgroups each issuing wgmma m64n256k16 (both operands K-major from
// shared memory, 128-byte swizzle, 1024-byte-aligned stages), 4 stages filled by cp.async two
// k-tiles ahead; after a stage lands every thread runs fence.proxy.async.shared::cta, then
// __syncthreads, then the wgmma reads it. 192 KB + 1 KB for alignment (kWgSmem).
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_pipeline.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
namespace gemm {

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4)  // start address
           | (static_cast<uint64_t>(1) << 16)            // leading byte offset (unused here)
           | (static_cast<uint64_t>(1024 >> 4) << 32)    // stride byte offset
           | (static_cast<uint64_t>(1) << 62);           // 128-byte swizzle
}

// Keeps the compiler from moving accumulator accesses across a wgmma fence, commit or wait.
template <uint32_t N>
__device__ __forceinline__ void wg_fence_operands(float (&d)[N]) {
#pragma unroll
    for (uint32_t i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
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

__device__ __forceinline__ void wgmma_m64n192k16(float (&d)[96], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
        "%96, %97, p, 1, 1, 0, 0;\n"
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
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(1)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1)
        : "memory");
}

__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1)
        : "memory");
}

// wgmma of one k16 step, by accumulator width: m64n256k16 (128 floats a thread), m64n192k16 (96),
// m64n128k16 (64) or m64n64k16 (32).
__device__ __forceinline__ void wgmma_k16(float (&d)[128], uint64_t da, uint64_t db) {
    wgmma_m64n256k16(d, da, db);
}

__device__ __forceinline__ void wgmma_k16(float (&d)[96], uint64_t da, uint64_t db) {
    wgmma_m64n192k16(d, da, db);
}

__device__ __forceinline__ void wgmma_k16(float (&d)[64], uint64_t da, uint64_t db) {
    wgmma_m64n128k16(d, da, db);
}

__device__ __forceinline__ void wgmma_k16(float (&d)[32], uint64_t da, uint64_t db) {
    wgmma_m64n64k16(d, da, db);
}

// One k-tile (kWgBK / 16 k16 steps) of a warpgroup's product from the swizzled stage: A rows at
// sa, B rows at sb (descriptors advance 32 bytes a step), committed as one wgmma group.
template <uint32_t N>
__device__ __forceinline__ void wgmma_k_tile(float (&d)[N], uint32_t sa, uint32_t sb) {
    wg_fence_operands(d);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (uint32_t ks = 0; ks < kWgBK / 16; ++ks) wgmma_k16(d, wg_desc(sa + ks * 32), wg_desc(sb + ks * 32));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// A stage of the wgmma path: 128-byte rows (k 64), 16-byte chunk ch of row r at ch ^ (r & 7): the
// 128-byte swizzle wgmma expects. Rows r and r + 32 share the swizzle.
struct WgmmaLayout {
    enum : uint32_t { kRowBytes = kWgBK * 2 };
    __device__ __forceinline__ static uint32_t offset(uint32_t r, uint32_t ch) {
        return r * kRowBytes + ((ch ^ (r & 7)) << 4);
    }
};

// Tile 128 x 256: warpgroup wg computes rows 64*wg .. +63 with one m64n256k16 per 16 k.
// Stage layout (each 1024-byte aligned): A 128 rows, then B 256 rows, WgmmaLayout.
// Per k-tile kt: wait for its copies, fence.proxy.async, barrier, issue 4 wgmma, then copy k-tile
// kt+2 into the stage of kt-2 (whose wgmma every warpgroup retired before the barrier), then
// wait until at most the group just issued is pending.
template <class Ep>
__device__ __forceinline__ void wgmma_gemm(const bf16* a, const bf16* w, bf16* c, uint32_t m,
                                           uint32_t n, uint32_t k, const Ep& ep) {
    using Loader = TileLoader<kWgBM, kWgBN, WgmmaLayout>;
    static_assert(Loader::kK == kWgBK && Loader::kStageBytes == kWgStageBytes, "wgmma stage");
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t wg = warp >> 2, wq = warp & 3, g = lane >> 2, t = lane & 3;
    const bool fast = fast_loads(a, w, k);
    const bool vec = vector_stores(c, n);
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const auto slot = Loader::slot(tid);
    const uint32_t ktiles = ceil_div(k, kWgBK);
    const uint64_t tiles_m = ceil_div(m, kWgBM), tiles_n = ceil_div(n, kWgBN);
    const uint64_t tiles = tiles_m * tiles_n;
    const CpAsyncRing<kWgStages, kWgStages - 2> pipe{ktiles};

    for (uint64_t tile = block_rank(); tile < tiles; tile += grid_blocks()) {
        uint64_t tm, tn;
        grouped_tile(tile, tiles_m, tiles_n, tm, tn);
        const uint32_t m0 = static_cast<uint32_t>(tm) * kWgBM, n0 = static_cast<uint32_t>(tn) * kWgBN;
        const bf16* asrc[Loader::kALoads];
        bool aok[Loader::kALoads];
        row_sources(a, m0 + slot.row, Loader::kRowsPerPass, m, k, asrc, aok);
        const bf16* wsrc[Loader::kBLoads];
        bool wok[Loader::kBLoads];
        row_sources(w, n0 + slot.row, Loader::kRowsPerPass, n, k, wsrc, wok);
        const Loader load{asrc, aok, wsrc, wok, base, slot, k, fast};

        float d[128];
#pragma unroll
        for (uint32_t i = 0; i < 128; ++i) d[i] = 0.0f;

        pipe.start(load);
        for (uint32_t kt = 0; kt < ktiles; ++kt) {
            pipe.wait();  // this thread's copies of k-tile kt landed
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma
            __syncthreads();
            const uint32_t sa = base + pipe.stage(kt) * Loader::kStageBytes;
            const uint32_t sa_wg = sa + wg * 64 * WgmmaLayout::kRowBytes, sb = sa + Loader::kABytes;
            wgmma_k_tile(d, sa_wg, sb);
            pipe.refill(kt, load);
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
        for (uint32_t j = 0; j < kWgBN / 8; ++j)
            store_fragment(c, row, n0 + 8 * j + 2 * t, m, n, d + 4 * j, vec, e0, e8);
    }
}

}  // namespace gemm
#endif  // __CUDA_ARCH_FEAT_SM90_ALL
