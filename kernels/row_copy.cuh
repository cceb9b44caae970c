// One warp copies one table row: the gathers of embed_from_argmax.cu and ngram_fused.cu.
//
// Lanes take consecutive 16-byte chunks, so each warp instruction moves 512 contiguous bytes,
// and four chunks per lane are loaded before the first store so enough bytes are in flight.
// The vector paths need dim % 8 == 0 and aligned table and output bases (bf16: 16 bytes both;
// fp8: 8-byte table, 16-byte output); anything else copies element by element. fp8 rows are
// dequantised as bf16(f32(e4m3) * scale): one f32 product (no FMA), one rounding to bf16, as
// layers/reference.py reproduces.
#pragma once
#include "common.cuh"

namespace rows {

constexpr uint32_t kWarp = 32;

__device__ __forceinline__ bool bf16_vec(const void* table, const void* out, uint32_t dim) {
    return dim % 8 == 0 && aligned16(table, out);
}
__device__ __forceinline__ bool fp8_vec(const void* table, const void* out, uint32_t dim) {
    return dim % 8 == 0 && (reinterpret_cast<uintptr_t>(table) & 7) == 0 &&
           (reinterpret_cast<uintptr_t>(out) & 15) == 0;
}

// Copy `count` items of type V from src to dst, one warp, four loads in flight per lane.
template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ src, V* __restrict__ dst,
                                          uint32_t count, uint32_t lane) {
    uint32_t i = lane;
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

// dst[0:dim] = src[0:dim]; `vec` from bf16_vec of the table and output bases.
__device__ __forceinline__ void copy_bf16_row(const bf16* src, bf16* dst, uint32_t dim, bool vec,
                                              uint32_t lane) {
    if (vec) {
        warp_copy(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), dim / 8, lane);
    } else {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
        uint16_t* d = reinterpret_cast<uint16_t*>(dst);
        for (uint32_t i = lane; i < dim; i += kWarp) d[i] = __ldg(s + i);
    }
}

// dst[j] = bf16(f32(src[j]) * scale); `vec` from fp8_vec of the table and output bases.
__device__ __forceinline__ void copy_fp8_row(const uint8_t* src, float scale, bf16* dst,
                                             uint32_t dim, bool vec, uint32_t lane) {
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

}  // namespace rows
