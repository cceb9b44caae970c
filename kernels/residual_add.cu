// Elementwise bf16 accumulation: out = bf16(out + scale * x) and out = bf16(out + x).
//
// fp32 in between with explicit round-to-nearest operations (no FMA contraction), so a numpy
// float32 reference matches bit for bit. 16-byte vectors when both pointers are 16-byte
// aligned, the n % 8 tail element-wise; grid-stride loops, so any grid is correct. Indices are
// 64-bit: a 32-bit index plus the stride wraps for n near 2**32 (an 8 GiB tensor).
#include "common.cuh"

namespace {

template <bool kScaled>
__device__ __forceinline__ float combine(float o, float x, float scale) {
    return kScaled ? scaled_sum(o, scale, x) : __fadd_rn(o, x);
}

template <bool kScaled>
__device__ __forceinline__ uint32_t combine2(uint32_t o, uint32_t x, float scale) {
    const float lo = combine<kScaled>(__uint_as_float(o << 16), __uint_as_float(x << 16), scale);
    const float hi = combine<kScaled>(__uint_as_float(o & 0xffff0000u),
                                      __uint_as_float(x & 0xffff0000u), scale);
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}

template <bool kScaled>
__device__ __forceinline__ void accumulate(bf16* out, const bf16* x, float scale, uint32_t n) {
    const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t tail = 0;
    if (aligned16(out, x)) {
        uint4* o4 = reinterpret_cast<uint4*>(out);
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const uint64_t vecs = n / 8;
        for (uint64_t i = tid; i < vecs; i += stride) {
            uint4 o = o4[i];
            const uint4 v = __ldg(x4 + i);
            o.x = combine2<kScaled>(o.x, v.x, scale);
            o.y = combine2<kScaled>(o.y, v.y, scale);
            o.z = combine2<kScaled>(o.z, v.z, scale);
            o.w = combine2<kScaled>(o.w, v.w, scale);
            o4[i] = o;
        }
        tail = vecs * 8;
    }
    for (uint64_t i = tail + tid; i < n; i += stride)
        out[i] = __float2bfloat16_rn(
            combine<kScaled>(__bfloat162float(out[i]), __bfloat162float(x[i]), scale));
}

}  // namespace

// out[i] = bf16(float(out[i]) + scale * float(x[i]))
extern "C" __global__ void bf16_scaled_add(bf16* out, const bf16* x, float scale, uint32_t n) {
    accumulate<true>(out, x, scale, n);
}

// out[i] = bf16(float(out[i]) + float(x[i]))
extern "C" __global__ void bf16_residual_add(bf16* out, const bf16* x, uint32_t n) {
    accumulate<false>(out, x, 0.0f, n);
}
