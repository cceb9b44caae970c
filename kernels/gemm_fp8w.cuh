// Part of gemm.cu (included after its sizes): the fp8-weight small path, for m <= 32 rows a work
// item (decode: bound by reading w once, half the bytes of a bf16 w).
//
// c[m, n] = a[m, k] @ W^T, a bf16, W the e4m3 w [n, k] with e8m0 block scales ws [ceil(n/32),
// k/32] (2^(byte - 127) per 32 x 32 block; k % 32 == 0, w 16-byte aligned: the launcher checks).
// Each weight is used as bf16(f32(e4m3) * 2^(byte - 127)): the value the bf16 path's dequantised
// weight holds, rounded once, so the products and the fp32 sums are those of the bf16 path over
// dequant_weight(w, ws, bfloat16) (the order of the sums differs).
//
// The small path's structure (gemm_small.cuh): a work item is 32 columns of c (one 32-row scale
// block of w, two m16 tiles) for up to 32 rows of a (NT = 1, 2 or 4 n8 tiles); the K loop is split
// across the 8 warps in 64-wide k-chunks; each lane copies 16 bytes of each w row it needs (16 k)
// and 32 bytes of each a row (the same 16 k), reads back only what it copied, and feeds them to
// four mma m16n8k16 (lane elements 4q .. 4q+3 in the q-th; a and w agree on this order of k); a
// fixed-order reduction across warps; one rounding. A lane's 16 k lie in one 32-wide scale block:
// one scale byte per lane per chunk. Items go slice by slice (the row blocks of one slice are
// neighbours, so a slice of w is read from memory once and from L2 after).
// Conversion: the bytes of an e4m3 placed in a bf16 (sign, then exponent and mantissa four bits
// lower) are its value times 2^-120, exactly (subnormals too); one bf16x2 fma by 2^(byte - 7)
// (two past byte 134, where that power leaves bf16's range) then rounds once. e4m3 NaN bytes
// (0x7f, 0xff) are not NaN here: the loaders refuse them.
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_pipeline.cuh"

namespace gemm {

// The bf16 pairs (bytes 0, 1) and (2, 3) of four e4m3 bytes, each value times 2^-120 (exact).
__device__ __forceinline__ void e4m3x4_as_bf16x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
    const uint32_t a = __byte_perm(x, 0u, 0x1404u), b = __byte_perm(x, 0u, 0x3424u);  // byte << 8 a half
    lo = (a & 0x80008000u) | ((a >> 4) & 0x07F007F0u);
    hi = (b & 0x80008000u) | ((b >> 4) & 0x07F007F0u);
}

// bf16x2 round(x * s), one rounding (an fma with -0.0: the sign of a zero product is kept).
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t x, uint32_t s) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(s), "r"(0x80008000u));
    return d;
}

// The bf16x2 factors that take e4m3 * 2^-120 to e4m3 * 2^(byte - 127): 2^(byte - 7), as one
// factor (s2 = 1) up to byte 134, else 2^127 then 2^(byte - 134) (the first product is exact).
struct Fp8Scale {
    uint32_t s1, s2;
    bool twice;
    __device__ __forceinline__ explicit Fp8Scale(uint32_t byte) {
        twice = byte > 134;
        const uint32_t e1 = twice ? 254u : byte + 120u, e2 = twice ? byte - 7u : 127u;
        s1 = (e1 << 7) * 0x10001u;
        s2 = (e2 << 7) * 0x10001u;
    }
    __device__ __forceinline__ uint32_t apply(uint32_t x) const {
        const uint32_t y = mul_bf16x2(x, s1);
        return twice ? mul_bf16x2(y, s2) : y;
    }
};

// One weight as the bf16 path holds it: bf16(f32(e4m3) * 2^(byte - 127)), as an f32.
__device__ __forceinline__ float fp8w_value(uint8_t q, uint8_t byte) {
    __nv_fp8_e4m3 f;
    f.__x = static_cast<__nv_fp8_storage_t>(q);
    return __bfloat162float(__float2bfloat16_rn(__fmul_rn(static_cast<float>(f), e8m0(byte))));
}

// The scalar path of the fp8 weight (any launch shape): one output per thread, an fp32 fma chain.
template <class Ep>
__device__ void fp8w_simt(const bf16* a, const uint8_t* w, const uint8_t* ws, bf16* c, uint32_t m,
                          uint32_t n, uint32_t k, const Ep& ep) {
    pdl_wait();
    const uint64_t block = static_cast<uint64_t>(blockDim.x) * blockDim.y * blockDim.z;
    const uint64_t tid = block_rank() * block + threadIdx.x +
                         static_cast<uint64_t>(blockDim.x) * (threadIdx.y + static_cast<uint64_t>(blockDim.y) * threadIdx.z);
    const uint64_t stride = grid_blocks() * block;
    const uint64_t total = static_cast<uint64_t>(m) * n;
    const uint32_t kblocks = k / kFp8Block;
    for (uint64_t i = tid; i < total; i += stride) {
        const uint64_t row = i / n, col = i % n;
        const bf16* ar = a + row * k;
        const uint8_t* wr = w + col * k;
        const uint8_t* sr = ws + (col / kFp8Block) * kblocks;
        float s = 0.0f;
        for (uint32_t kk = 0; kk < k; ++kk)
            s = fmaf(__bfloat162float(ar[kk]), fp8w_value(wr[kk], sr[kk / kFp8Block]), s);
        c[i] = __float2bfloat16_rn(ep.row(row, m).apply(static_cast<uint32_t>(col), s));
    }
}

template <uint32_t NT, class Ep>
__device__ __forceinline__ void fp8w_small_gemm(const bf16* a, const uint8_t* w, const uint8_t* ws,
                                                bf16* c, uint32_t m, uint32_t n, uint32_t k,
                                                const Ep& ep) {
    constexpr uint32_t kStages = fp8w_stages(NT);
    constexpr uint32_t kAPieces = 2 * NT;  // 32 bytes of each a row a lane
    constexpr uint32_t kStageBytes = (kSmallWPieces + kAPieces) * kPieceBytes;
    constexpr uint32_t kRedRows = NT * 8;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t g = lane >> 2, t = lane & 3;
    const bool fast = (k % 8 == 0) && aligned16(a, a);
    const bool vec = vector_stores(c, n);
    const uint32_t chunks = ceil_div(k, kFp8Chunk), kblocks = k / kFp8Block;
    const uint32_t mine = warp < chunks ? (chunks - warp + kWarps - 1) / kWarps : 0;
    const uint32_t ring = smem_u32(smem_raw) + warp * kStages * kStageBytes + lane * 16;
    float* red = reinterpret_cast<float*>(smem_raw);
    const uint64_t blocks_m = ceil_div(m, kFp8MaxRows);
    const uint64_t items = ceil_div(n, kSmallCols) * blocks_m;
    const CpAsyncRing<kStages, kStages - 1> pipe{mine};

    for (uint64_t item = block_rank(); item < items; item += grid_blocks()) {
        const uint32_t col0 = static_cast<uint32_t>(item / blocks_m) * kSmallCols;
        const uint32_t row0 = static_cast<uint32_t>(item % blocks_m) * kFp8MaxRows;
        const uint8_t* wsrc[kSmallWPieces];
        bool wok[kSmallWPieces];
#pragma unroll
        for (uint32_t p = 0; p < kSmallWPieces; ++p) {
            const uint32_t r = col0 + g + 8 * p;
            wok[p] = r < n;
            wsrc[p] = w + static_cast<uint64_t>(wok[p] ? r : 0) * k + 16 * t;
        }
        const bf16* asrc[NT];
        bool aok[NT];
        row_sources(a, row0 + g, 8, m, k, asrc, aok);
        const uint8_t* scales = ws + static_cast<uint64_t>(col0 / kFp8Block) * kblocks;
        // This lane's first k of chunk i (its 16 k: kk .. kk + 15, in block kk / 32).
        auto first_k = [&](uint32_t i) { return (warp + i * kWarps) * kFp8Chunk + 16 * t; };
        // parts: 1 = the w pieces of a stage, 2 = its a pieces, 3 = both.
        auto load = [&](uint32_t stage, uint32_t i, uint32_t parts = 3) {
            const uint32_t kk = first_k(i);
            const bool kin = kk < k;
            const uint32_t dst = ring + stage * kStageBytes;
            if (parts & 1) {
#pragma unroll
                for (uint32_t p = 0; p < kSmallWPieces; ++p) {
                    const bool ok = wok[p] && kin;
                    cp_async16(dst + p * kPieceBytes, ok ? wsrc[p] + (kk - 16 * t) : w, ok ? 16u : 0u);
                }
            }
            if (parts & 2) {
                with_load_kind(fast, [&](auto kind) {
                    const uint32_t sa = dst + kSmallWPieces * kPieceBytes;  // pieces 2j, 2j + 1: row 8j + g
                    load_rows(kind, asrc, aok, sa, 2 * kPieceBytes, kk, kin, k);
                    load_rows(kind, asrc, aok, sa + kPieceBytes, 2 * kPieceBytes, kk + 8, kin, k);
                });
            }
        };
        auto scale_of = [&](uint32_t i) {
            const uint32_t kk = first_k(i);
            return kk < k ? static_cast<uint32_t>(__ldg(scales + kk / kFp8Block)) : 127u;
        };

        float acc[2][NT][4];
#pragma unroll
        for (uint32_t i = 0; i < 2; ++i)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

        // As the small path: the first item's w stages are requested before pdl_wait.
        const bool first = item == block_rank();
        if (first) {
#pragma unroll 1
            for (uint32_t s = 0; s < kStages - 1; ++s)
                if (s < mine) load(s, s, 1);
            pdl_wait();
        }
        pipe.start([&](uint32_t stage, uint32_t i) { load(stage, i, first ? 2 : 3); });
        uint32_t next_scale = mine > 0 ? scale_of(0) : 127u;
        for (uint32_t i = 0; i < mine; ++i) {
            pipe.wait();  // this lane's copies of chunk i have landed
            pipe.refill(i, load);
            const Fp8Scale scale(next_scale);
            if (i + 1 < mine) next_scale = scale_of(i + 1);
            const uint32_t src = ring + pipe.stage(i) * kStageBytes;
            uint4 wv[kSmallWPieces], av[kAPieces];
#pragma unroll
            for (uint32_t p = 0; p < kSmallWPieces; ++p) wv[p] = ld_shared16(src + p * kPieceBytes);
#pragma unroll
            for (uint32_t j = 0; j < kAPieces; ++j) av[j] = ld_shared16(src + (kSmallWPieces + j) * kPieceBytes);
#pragma unroll
            for (uint32_t q = 0; q < 4; ++q) {  // lane elements 4q .. 4q+3: word q of a w piece
                uint32_t lo[kSmallWPieces], hi[kSmallWPieces];
#pragma unroll
                for (uint32_t p = 0; p < kSmallWPieces; ++p) {
                    const uint32_t x = q == 0 ? wv[p].x : q == 1 ? wv[p].y : q == 2 ? wv[p].z : wv[p].w;
                    e4m3x4_as_bf16x4(x, lo[p], hi[p]);
                    lo[p] = scale.apply(lo[p]);
                    hi[p] = scale.apply(hi[p]);
                }
#pragma unroll
                for (uint32_t j = 0; j < NT; ++j) {
                    const uint4 v = av[2 * j + q / 2];  // a elements 4q .. 4q+3: words 2(q%2), +1
                    const uint32_t b0 = q % 2 == 0 ? v.x : v.z, b1 = q % 2 == 0 ? v.y : v.w;
#pragma unroll
                    for (uint32_t ti = 0; ti < 2; ++ti)  // w rows 16ti + g (piece 2ti) and + 8
                        mma_bf16(acc[ti][j], lo[2 * ti], lo[2 * ti + 1], hi[2 * ti], hi[2 * ti + 1], b0, b1);
                }
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with its ring: reuse the memory for the reduction

        // acc[ti][j]: e0 (w row 16ti+g, a row 8j+2t), e1 (same w row, a row +1), e2/e3 (w row +8).
        float* mine_red = red + warp * (kRedRows * kRedStride);
#pragma unroll
        for (uint32_t ti = 0; ti < 2; ++ti)
#pragma unroll
            for (uint32_t j = 0; j < NT; ++j) {
                const uint32_t r = 8 * j + 2 * t, col = 16 * ti + g;
                mine_red[r * kRedStride + col] = acc[ti][j][0];
                mine_red[(r + 1) * kRedStride + col] = acc[ti][j][1];
                mine_red[r * kRedStride + col + 8] = acc[ti][j][2];
                mine_red[(r + 1) * kRedStride + col + 8] = acc[ti][j][3];
            }
        __syncthreads();

        const uint32_t rows = (m - row0) < kRedRows ? (m - row0) : kRedRows;
        for (uint32_t idx = threadIdx.x; idx < rows * (kSmallCols / 2); idx += kThreads) {
            const uint32_t r = idx / (kSmallCols / 2), col = 2 * (idx % (kSmallCols / 2));
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (uint32_t wp = 0; wp < kWarps; ++wp) {  // fixed order: deterministic
                const float* src = red + wp * (kRedRows * kRedStride) + r * kRedStride + col;
                s0 += src[0];
                s1 += src[1];
            }
            const uint64_t row = static_cast<uint64_t>(row0) + r;
            store_pair(c, row, col0 + col, n, s0, s1, vec, ep.row(row, m));
        }
        __syncthreads();  // the next item's copies overwrite the reduction buffer
    }
}

}  // namespace gemm
