// Row cache loads: copy a batch of staged table rows into their slots of the device arena.
//
// The host packs one batch into one pinned buffer (slots, rows, scales), uploads it with one
// copy, and this kernel scatters it: one warp per row, through row_copy.cuh (16-byte chunks when
// the row size and the addresses allow it: rows of 16-byte multiples, every bf16 dim % 8 == 0,
// fp8 dim % 16 == 0; bytes otherwise). Slots are validated on the host (each < the arena's
// capacity, no repeats).
#include "row_copy.cuh"

extern "C" __global__ void scatter_rows(const uint32_t* slots, const uint8_t* rows,
                                        const float* scales, uint8_t* arena, float* arena_scales,
                                        uint32_t n, uint32_t row_bytes) {
    const uint32_t lane = threadIdx.x % 32;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / 32;
    const bool vec = row_copy::bytes_vec(rows, arena, row_bytes);
    // 64-bit index: with n near 2**32 a 32-bit i + warps wraps below n and the loop never ends
    for (uint64_t i = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < n; i += warps) {
        const uint32_t slot = slots[i];
        row_copy::copy_row<uint8_t>(rows + static_cast<uint64_t>(i) * row_bytes,
                                    arena + static_cast<uint64_t>(slot) * row_bytes, row_bytes, vec,
                                    row_copy::Warp{lane});
        if (scales != nullptr && lane == 0) arena_scales[slot] = scales[i];
    }
}
