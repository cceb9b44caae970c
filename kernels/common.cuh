// Shared by every kernel module: fixed-width integer types (NVRTC has no <cstdint> without
// extra headers), the bf16 / fp8 type names the signatures use, and small helpers.
#pragma once

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned long long uintptr_t;
#else
#include <cstdint>
#endif

#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef __nv_fp8_e4m3 fp8;

// The word id of a row written as zeros: ngram_decode.cu gives it to rows of bad input, and
// gemm.cu's word epilogue (gemm_epilogue.cuh) writes such a row as zeros. An enumerator, not a
// constexpr variable: with -default-device NVRTC emits every such variable as a device global
// into every module that includes this header.
enum : uint32_t { kNoWord = 0xffffffffu };

// True when every pointer given is 16-byte aligned (the vector paths need it).
__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
    return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

// 2^(byte - 127) as an f32 (byte 0: 2^-127, a subnormal; 255, e8m0's NaN: NaN).
__device__ __forceinline__ float e8m0(uint32_t byte) {
    const uint32_t bits = byte == 0 ? 0x00400000u : byte == 255 ? 0x7fc00000u : byte << 23;
    return __uint_as_float(bits);
}

// out + scale * x with exactly two fp32 roundings and no FMA contraction, so numpy's float32
// arithmetic reproduces it bit for bit.
__device__ __forceinline__ float scaled_sum(float out, float scale, float x) {
    return __fadd_rn(out, __fmul_rn(scale, x));
}

// Programmatic dependent launch (sm_90; no-ops before it, and where the launch was a plain one):
// pdl_launch_dependents lets the next kernel on the stream start now (it must wait for this one's
// writes itself); pdl_wait waits until the previous kernel has finished and its writes are visible.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
