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
    const uint32_t lane = threadIdx.x % row_copy::kWarp;
    const bool vec = row_copy::bytes_vec(rows, arena, row_bytes);
    for (uint64_t i = row_copy::global_warp(); i < n; i += row_copy::warp_count()) {
        const uint32_t slot = slots[i];
        row_copy::copy_row<uint8_t>(rows + static_cast<uint64_t>(i) * row_bytes,
                                    arena + static_cast<uint64_t>(slot) * row_bytes, row_bytes, vec,
                                    row_copy::Warp{lane});
        if (scales != nullptr && lane == 0) arena_scales[slot] = scales[i];
    }
}
