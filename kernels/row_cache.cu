// Row cache loads: copy a batch of staged table rows into their slots of the device arena.
//
// The host packs one batch into one pinned buffer (slots, rows, scales), uploads it with one
// copy, and this kernel scatters it: one warp per row, 16-byte chunks when the row size and the
// addresses allow it (rows of 16-byte multiples: every bf16 dim % 8 == 0, fp8 dim % 16 == 0),
// bytes otherwise. Slots are validated on the host (each < the arena's capacity, no repeats).
#include "common.cuh"

extern "C" __global__ void scatter_rows(const uint32_t* slots, const uint8_t* rows,
                                        const float* scales, uint8_t* arena, float* arena_scales,
                                        uint32_t n, uint32_t row_bytes) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warps = gridDim.x * blockDim.x / 32;
    const bool vec = row_bytes % 16 == 0 && aligned16(rows, arena);
    for (uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) / 32; i < n; i += warps) {
        const uint32_t slot = slots[i];
        const uint8_t* src = rows + static_cast<uint64_t>(i) * row_bytes;
        uint8_t* dst = arena + static_cast<uint64_t>(slot) * row_bytes;
        if (vec) {
            const uint4* s = reinterpret_cast<const uint4*>(src);
            uint4* d = reinterpret_cast<uint4*>(dst);
            for (uint32_t j = lane; j < row_bytes / 16; j += 32) d[j] = s[j];
        } else {
            for (uint32_t j = lane; j < row_bytes; j += 32) dst[j] = src[j];
        }
        if (scales != nullptr && lane == 0) arena_scales[slot] = scales[i];
    }
}
