// Every row copy of kernels/: a row of a table (or of a staging buffer) into an output row.
//
// A team of threads copies one row: a Warp (the gathers of embed_from_argmax.cu, ngram_fused.cu
// and ngram_decode.cu, and row_cache.cu's scatter), or a whole Block (embed_from_argmax_bf16 and
// token_overlay.cu's embed_overlay_routed_bf16). Threads take consecutive 16-byte chunks, so each
// warp instruction moves 512 contiguous bytes; a warp loads four chunks per lane before the first
// store so enough bytes are in flight. The vector paths need a row size of a multiple of 16 bytes
// and aligned table and output bases (bf16: 16 bytes both; fp8: 8-byte table, 16-byte output);
// anything else copies element by element. fp8 rows are dequantised as bf16(f32(e4m3) * scale):
// one f32 product (no FMA), one rounding to bf16, as layers/reference.py's dequant_fp8 does.
// Every load goes through the read-only path (__ldg): no kernel writes the rows it copies from.
#pragma once
#include "common.cuh"

namespace row_copy {

constexpr uint32_t kWarp = 32;

// A grid-stride loop of one row per warp: for (uint64_t r = global_warp(); r < n; r += warp_count()).
// 64-bit: for n >= 2**27 rows the grid's threads pass 2**32, and n near 2**32 wraps a 32-bit row
// index plus the stride.
__device__ __forceinline__ uint64_t global_warp() {
    return (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}
__device__ __forceinline__ uint64_t warp_count() {
    return static_cast<uint64_t>(gridDim.x) * blockDim.x / kWarp;
}

// The threads that copy one row together, and how: first() is this thread's first item, stride()
// the team's size.
struct Warp {
    uint32_t lane;
    __device__ __forceinline__ uint32_t first() const { return lane; }
    __device__ __forceinline__ uint32_t stride() const { return kWarp; }
};
struct Block {
    __device__ __forceinline__ uint32_t first() const { return threadIdx.x; }
    __device__ __forceinline__ uint32_t stride() const { return blockDim.x; }
};

__device__ __forceinline__ bool bf16_vec(const void* table, const void* out, uint32_t dim) {
    return dim % 8 == 0 && aligned16(table, out);
}
__device__ __forceinline__ bool fp8_vec(const void* table, const void* out, uint32_t dim) {
    return dim % 8 == 0 && (reinterpret_cast<uintptr_t>(table) & 7) == 0 &&
           (reinterpret_cast<uintptr_t>(out) & 15) == 0;
}
__device__ __forceinline__ bool bytes_vec(const void* table, const void* out, uint32_t bytes) {
    return bytes % 16 == 0 && aligned16(table, out);
}

// dst[i] = src[i] for i < count, item i by the team's thread i % stride.
template <typename V, class Team>
__device__ __forceinline__ void strided_copy(const V* src, V* dst, uint32_t count, Team team) {
    for (uint32_t i = team.first(); i < count; i += team.stride()) dst[i] = __ldg(src + i);
}

// The 16-byte chunks of a row: a block in one strided pass; a warp with four loads in flight
// per lane.
template <typename V>
__device__ __forceinline__ void vector_copy(const V* src, V* dst, uint32_t count, Block team) {
    strided_copy(src, dst, count, team);
}
template <typename V>
__device__ __forceinline__ void vector_copy(const V* __restrict__ src, V* __restrict__ dst,
                                            uint32_t count, Warp team) {
    uint32_t i = team.lane;
    for (; i + 3 * kWarp < count; i += 4 * kWarp) {
        V a = __ldg(src + i), b = __ldg(src + i + kWarp);
        V c = __ldg(src + i + 2 * kWarp), d = __ldg(src + i + 3 * kWarp);
        dst[i] = a;
        dst[i + kWarp] = b;
        dst[i + 2 * kWarp] = c;
        dst[i + 3 * kWarp] = d;
    }
    for (; i < count; i += kWarp) dst[i] = __ldg(src + i);
}

// dst[0:count] = src[0:count], elements E (bf16 bits or bytes): 16-byte chunks when `vec` (from
// bf16_vec / bytes_vec of the table and output bases), one element per item otherwise.
template <typename E, class Team>
__device__ __forceinline__ void copy_row(const void* src, void* dst, uint32_t count, bool vec,
                                         Team team) {
    if (vec) {
        vector_copy(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                    count / (16 / sizeof(E)), team);
    } else {
        strided_copy(static_cast<const E*>(src), static_cast<E*>(dst), count, team);
    }
}

// dst[0:dim] = src[0:dim]; `vec` from bf16_vec of the table and output bases.
template <class Team>
__device__ __forceinline__ void copy_bf16_row(const bf16* src, bf16* dst, uint32_t dim, bool vec,
                                              Team team) {
    copy_row<uint16_t>(src, dst, dim, vec, team);
}

__device__ __forceinline__ bf16 dequant(uint8_t bits, float scale) {
    __nv_fp8_e4m3 v;
    v.__x = bits;
    return __float2bfloat16_rn(__fmul_rn(static_cast<float>(v), scale));
}

__device__ __forceinline__ uint32_t pack_bf16x2(bf16 lo, bf16 hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

__device__ __forceinline__ uint4 dequant8(uint2 q, float s) {
    uint4 r;
    r.x = pack_bf16x2(dequant(q.x & 0xff, s), dequant((q.x >> 8) & 0xff, s));
    r.y = pack_bf16x2(dequant((q.x >> 16) & 0xff, s), dequant(q.x >> 24, s));
    r.z = pack_bf16x2(dequant(q.y & 0xff, s), dequant((q.y >> 8) & 0xff, s));
    r.w = pack_bf16x2(dequant((q.y >> 16) & 0xff, s), dequant(q.y >> 24, s));
    return r;
}

// dst[j] = bf16(f32(src[j]) * scale), one warp; `vec` from fp8_vec of the table and output bases.
__device__ __forceinline__ void copy_fp8_row(const uint8_t* src, float scale, bf16* dst,
                                             uint32_t dim, bool vec, Warp team) {
    const uint32_t lane = team.lane;
    if (vec) {
        const uint2* s = reinterpret_cast<const uint2*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint32_t count = dim / 8;
        uint32_t i = lane;
        for (; i + kWarp < count; i += 2 * kWarp) {
            const uint2 a = __ldg(s + i), b = __ldg(s + i + kWarp);
            d[i] = dequant8(a, scale);
            d[i + kWarp] = dequant8(b, scale);
        }
        for (; i < count; i += kWarp) d[i] = dequant8(__ldg(s + i), scale);
    } else {
        for (uint32_t i = lane; i < dim; i += kWarp) dst[i] = dequant(__ldg(src + i), scale);
    }
}

}  // namespace row_copy
