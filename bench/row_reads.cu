// Benchmark-only kernels (bench/row_reads.py, bench/real_scale.py, bench/engram.py): random row reads
// spread over a footprint of device (or mapped host) memory, and a fill of bf16 tables on the device.
#include "../kernels/common.cuh"

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

constexpr uint32_t kMaxInFlight = 8;

}  // namespace

// data[i] = scale * u(seed, i) for i < n as bf16 bits, u uniform in [-1, 1) from a hash.
extern "C" __global__ void fill_random_bf16(uint16_t* data, uint64_t n, uint64_t seed, float scale) {
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float u = static_cast<float>(static_cast<int32_t>(mix64(seed ^ i) >> 32)) * 0x1p-31f;
        data[i] = __bfloat16_as_ushort(__float2bfloat16_rn(u * scale));
    }
}

// Warp w reads rows i = w * per_warp .. w * per_warp + per_warp - 1 of the call's `reads`,
// `in_flight` (1..8) at a time: read i goes to table c = i * tables / reads (table-major, as the
// n-gram gathers order their pairs), row mix64(seed, i) % table_rows of that table, 512 bytes at
// data + (c * table_rows + row) * 512, each lane loading 16 bytes. sink[w] is written only when
// the xor of everything read hits one value, so the loads cannot be dropped. With `in_order`, a
// table's reads are in address order instead: its j-th of n reads a random row of the j-th of n
// equal slices (the order a gather of sorted ids would read in).
extern "C" __global__ void read_random_rows(const uint4* data, uint64_t table_rows, uint32_t tables,
                                            uint32_t reads, uint32_t per_warp, uint32_t in_flight,
                                            uint32_t in_order, uint64_t seed, uint32_t* sink) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const uint32_t first = warp * per_warp;
    uint32_t acc = 0;
    for (uint32_t j = 0; j < per_warp; j += in_flight) {
        uint4 v[kMaxInFlight];
#pragma unroll
        for (uint32_t k = 0; k < kMaxInFlight; ++k) {
            const uint32_t i = first + j + k;
            v[k] = make_uint4(0, 0, 0, 0);
            if (k < in_flight && j + k < per_warp && i < reads) {
                const uint64_t c = static_cast<uint64_t>(i) * tables / reads;
                const uint64_t h = mix64(seed * 0x100000001b3ull + i);
                uint64_t row = h % table_rows;
                if (in_order) {  // reads [lo, hi) of table c, each in its slice of the rows
                    const uint64_t lo = (c * reads + tables - 1) / tables, hi = ((c + 1) * reads + tables - 1) / tables;
                    const uint64_t slice = table_rows / (hi - lo);
                    row = (i - lo) * slice + h % slice;
                }
                v[k] = __ldcg(data + (c * table_rows + row) * 32 + lane);
            }
        }
#pragma unroll
        for (uint32_t k = 0; k < kMaxInFlight; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0x9e3779b9u) sink[warp] = acc;
}

// Rows of `row_words` 8-byte words (at most 4 * 32: 1 KiB) at 8-byte alignment, such as Engram's packed
// 264-byte rows: warp i reads read i, table c = i * tables / reads, row mix64(seed, i) % table_rows
// of it at data + (c * table_rows + row) * row_words, lane l loading words l, l + 32, ... (all
// issued before any is used: one round trip a row, as a gather's loads are). sink as above.
extern "C" __global__ void read_random_rows_8(const uint2* data, uint64_t table_rows, uint32_t tables,
                                              uint32_t reads, uint32_t row_words, uint64_t seed,
                                              uint32_t* sink) {
    constexpr uint32_t kWords = 4;  // loads per lane
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t i = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (i >= reads) return;  // warp-uniform
    const uint64_t c = static_cast<uint64_t>(i) * tables / reads;
    const uint64_t row = mix64(seed * 0x100000001b3ull + i) % table_rows;
    const uint2* src = data + (c * table_rows + row) * row_words;
    uint2 v[kWords];
#pragma unroll
    for (uint32_t k = 0; k < kWords; ++k) {
        const uint32_t w = lane + 32 * k;
        v[k] = w < row_words ? __ldcg(src + w) : make_uint2(0, 0);
    }
    uint32_t acc = 0;
#pragma unroll
    for (uint32_t k = 0; k < kWords; ++k) acc ^= v[k].x ^ v[k].y;
    if (acc == 0x9e3779b9u) sink[i] = acc;
}
