// Part of gemm.cu (included after its sizes): launch geometry and the PTX instructions that every
// path of the GEMM uses.
#pragma once
#include "common.cuh"

namespace gemm {

extern __shared__ __align__(1024) unsigned char smem_raw[];

// -- launch geometry --------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

__device__ __forceinline__ bool block_is_256() {
    return blockDim.x == kThreads && blockDim.y == 1 && blockDim.z == 1;
}

__device__ __forceinline__ uint64_t block_rank() {
    return blockIdx.x + static_cast<uint64_t>(gridDim.x) *
                            (blockIdx.y + static_cast<uint64_t>(gridDim.y) * blockIdx.z);
}

__device__ __forceinline__ uint64_t grid_blocks() {
    return static_cast<uint64_t>(gridDim.x) * gridDim.y * gridDim.z;
}

__device__ __forceinline__ uint32_t ceil_div(uint32_t x, uint32_t d) {
    return x / d + (x % d != 0);
}

__device__ __forceinline__ bool fast_loads(const bf16* a, const bf16* w, uint32_t k) {
    return (k % 8 == 0) && aligned16(a, w);
}

__device__ __forceinline__ bool vector_stores(const bf16* c, uint32_t n) {
    return (n % 2 == 0) && ((reinterpret_cast<uintptr_t>(c) & 3) == 0);
}

// (tile row, tile column) of linear tile `tile`: column-major inside groups of kGroupM tile
// rows, so the CTAs running at once share a few rows of a and columns of w in L2.
__device__ __forceinline__ void grouped_tile(uint64_t tile, uint64_t tiles_m, uint64_t tiles_n,
                                             uint64_t& tm, uint64_t& tn) {
    const uint64_t group = static_cast<uint64_t>(kGroupM) * tiles_n;
    const uint64_t first_m = (tile / group) * kGroupM;
    const uint64_t left = tiles_m - first_m;
    const uint64_t rows = left < kGroupM ? left : kGroupM;
    const uint64_t in_group = tile % group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
}

// -- PTX --------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// cp_async16 that also asks L2 to fetch the whole 256-byte block around src (a hint): a warp that
// streams rows 64 bytes at a time then finds the next three pieces in L2, and DRAM serves 256-byte
// bursts.
__device__ __forceinline__ void cp_async16_l2_256(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

__device__ __forceinline__ void st_shared16(uint32_t dst, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ uint4 ld_shared16(uint32_t src) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(src) : "memory");
    return v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t src) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(src) : "memory");
}

// d += A (16x16, row) * B (16x8, col); bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace gemm
