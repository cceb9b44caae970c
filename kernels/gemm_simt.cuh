// Part of gemm.cu (included after its sizes): the simt path, one output per thread with an fp32
// fma chain. It runs under any launch shape: the fallback of every entry point whose block or
// shared memory does not fit its path, and a reference on the device.
#pragma once
#include "gemm_common.cuh"

namespace gemm {

template <class Ep>
__device__ void gemm_simt(const bf16* a, const bf16* w, bf16* c, uint32_t m, uint32_t n, uint32_t k,
                          const Ep& ep) {
    const uint64_t block = static_cast<uint64_t>(blockDim.x) * blockDim.y * blockDim.z;
    const uint64_t tid = block_rank() * block + threadIdx.x +
                         static_cast<uint64_t>(blockDim.x) * (threadIdx.y + static_cast<uint64_t>(blockDim.y) * threadIdx.z);
    const uint64_t stride = grid_blocks() * block;
    const uint64_t total = static_cast<uint64_t>(m) * n;
    for (uint64_t i = tid; i < total; i += stride) {
        const uint64_t row = i / n, col = i % n;
        const bf16* ar = a + row * k;
        const bf16* wr = w + col * k;
        float s = 0.0f;
        for (uint32_t kk = 0; kk < k; ++kk)
            s = fmaf(__bfloat162float(ar[kk]), __bfloat162float(wr[kk]), s);
        c[i] = __float2bfloat16_rn(ep.row(row, m).apply(static_cast<uint32_t>(col), s));
    }
}

}  // namespace gemm
