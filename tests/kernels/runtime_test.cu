// Kernels used only by the runtime's own tests.
#include "../../kernels/common.cuh"

// Writes back every argument kind it receives, to check KernelLaunch's packing end to end.
extern "C" __global__ void arg_echo(uint64_t* out, uint32_t u, int32_t i, float f, uint64_t l,
                                    const void* p) {
    out[0] = u;
    out[1] = static_cast<uint64_t>(static_cast<int64_t>(i));
    out[2] = __float_as_uint(f);
    out[3] = l;
    out[4] = reinterpret_cast<uint64_t>(p);
}

// dst[i] = src[i] + add, for ordering tests.
extern "C" __global__ void add_u32(uint32_t* dst, const uint32_t* src, uint32_t add, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[i] = src[i] + add;
}

// Keeps the stream busy for about `ns` nanoseconds, so that a later copy is still pending.
extern "C" __global__ void spin(uint64_t ns) {
    uint64_t start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
