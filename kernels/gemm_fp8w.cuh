// Part of gemm.cu (included after its sizes): the fp8-weight path, for up to 64 rows of a (decode:
// bound by reading w once, half the bytes of a bf16 w).
//
// c[m, n] = a[m, k] @ W^T, a bf16, W the e4m3 w [n, k] with e8m0 block scales ws [ceil(n/32),
// k/32] (2^(byte - 127) per 32 x 32 block; k % 32 == 0, w 16-byte aligned: the launcher checks).
// Each weight is used as bf16(f32(e4m3) * 2^(byte - 127)): the value the bf16 path's dequantised
// weight holds, rounded once, so the products and the fp32 sums are those of the bf16 path over
// dequant_weight(w, ws, bfloat16) (the order of the sums differs; a row's order depends on k and
// the slab ks only, never on m or the other rows: batch invariant for a fixed ks).
// Conversion: the bytes of an e4m3 placed in a bf16 (sign, then exponent and mantissa four bits
// lower) are its value times 2^-120, exactly (subnormals too); one bf16x2 fma by 2^(byte - 7)
// (two past byte 134, where that power leaves bf16's range) then rounds once. e4m3 NaN bytes
// (0x7f, 0xff) are not NaN here: the loaders refuse them.
#pragma once
#include "gemm_epilogue.cuh"
#include "gemm_pipeline.cuh"

namespace gemm {

// The bf16 pairs (bytes 0, 1) and (2, 3) of four e4m3 bytes, each value times 2^-120 (exact):
// bf16 bits (byte & 0x80) << 8 | (byte & 0x7f) << 4, built for the four bytes at once as their
// low bytes (the byte's low nibble, high) and high bytes (sign, then bits 6..4), then paired.
__device__ __forceinline__ void e4m3x4_as_bf16x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
    const uint32_t low = (x << 4) & 0xF0F0F0F0u, high = ((x >> 4) & 0x07070707u) | (x & 0x80808080u);
    lo = __byte_perm(low, high, 0x5140u);
    hi = __byte_perm(low, high, 0x7362u);
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
    __device__ __forceinline__ explicit Fp8Scale(uint32_t byte) {
        const bool twice = byte > 134;
        const uint32_t e1 = twice ? 254u : byte + 120u, e2 = twice ? byte - 7u : 127u;
        s1 = (e1 << 7) * 0x10001u;
        s2 = (e2 << 7) * 0x10001u;
    }
    // kTwice: whether any lane of the warp has a byte past 134 (the second product, by s2 = 1
    // where this lane's is not, is exact): a warp-uniform choice, so the common case runs one.
    template <bool kTwice>
    __device__ __forceinline__ uint32_t apply(uint32_t x) const {
        const uint32_t y = mul_bf16x2(x, s1);
        return kTwice ? mul_bf16x2(y, s2) : y;
    }
};

// Whether a warp's scales take two products, as a type (the chunk loop is compiled for each).
template <bool kTwice>
struct Fp8Twice {
    static constexpr bool value = kTwice;
};

// Whether any of the scale bytes packed in lo and hi takes two products (byte > 134).
__device__ __forceinline__ bool fp8_any_twice(uint32_t lo, uint32_t hi) {
    return (__vcmpgtu4(lo, 0x86868686u) | __vcmpgtu4(hi, 0x86868686u)) != 0u;
}

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

// The scale bytes of one work item (ks / 32 blocks from block kb0 of row `row` of ws, none past
// kblocks): `load` issues the loads (lane l: blocks l + 32u, u < 8; 127 where there is none) into
// `raw`, `pack` (an item later, when they have landed) packs them, byte u % 4 of word u / 4.
struct Fp8ItemScales {
    uint32_t raw[8];
    uint32_t lo, hi;
    __device__ __forceinline__ void load(const uint8_t* ws, uint64_t row, uint32_t kb0, uint32_t count,
                                         uint32_t kblocks, uint32_t lane) {
#pragma unroll
        for (uint32_t u = 0; u < 8; ++u) {
            const uint32_t kb = lane + 32 * u;
            raw[u] = kb < count && kb0 + kb < kblocks ? __ldg(ws + row * kblocks + kb0 + kb) : 127u;
        }
    }
    __device__ __forceinline__ void pack() {
        lo = raw[0] | (raw[1] << 8) | (raw[2] << 16) | (raw[3] << 24);
        hi = raw[4] | (raw[5] << 8) | (raw[6] << 16) | (raw[7] << 24);
    }
    // The byte of block kb (< 256) of the item, for this lane (every lane of the warp calls it;
    // kb / 32 must be the same across the warp).
    __device__ __forceinline__ uint32_t byte(uint32_t kb) const {
        const uint32_t u = kb / 32;
        return (__shfl_sync(0xffffffffu, u < 4 ? lo : hi, kb % 32) >> (8 * (u % 4))) & 0xffu;
    }
};

// Rows 0 .. 8 NT - 1 of a's k-slab [kk0, kk0 + ks) into shared memory (row r at slab + r * pitch,
// zeros past m and k), by every thread of the CTA, with plain loads.
template <uint32_t NT>
__device__ __forceinline__ void fp8w_load_slab(const bf16* a, uint32_t m, uint32_t k, uint32_t kk0, uint32_t ks,
                                               uint32_t slab, uint32_t pitch) {
    const bool fast = aligned16(a, a);  // k % 8 == 0 (k % 32 == 0)
    const uint32_t per_row = ks / 8, total = NT * 8 * per_row;
#pragma unroll 4
    for (uint32_t v = threadIdx.x; v < total; v += kThreads) {
        const uint32_t r = v / per_row, e = (v % per_row) * 8, kk = kk0 + e;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (r < m && kk < k) {
            const bf16* row = a + static_cast<uint64_t>(r) * k;
            val = fast ? __ldg(reinterpret_cast<const uint4*>(row + kk)) : load8_scalar(row, kk, k);
        }
        st_shared16(slab + r * pitch + e * 2, val);
    }
}

// c[row][col] = bf16(work[0][row][col] + work[1][row][col] + ...) for rows 0 .. m - 1, the slabs
// added in order. Eight rows' loads of four slabs are issued before any is added (a load after a
// store to c would wait for it: the compiler cannot tell c and work apart), so the sums wait on
// ceil(m / 8) * ceil(slabs / 4) rounds of L2 latency, not m * slabs.
__device__ __forceinline__ void fp8w_sum_slabs(const float* work, bf16* c, uint32_t m, uint32_t n, uint32_t col,
                                               uint32_t slabs) {
    constexpr uint32_t kRows = 8, kSlabs = 4;
    const uint64_t slab_stride = static_cast<uint64_t>(kFp8MaxRows) * n;
    for (uint32_t r0 = 0; r0 < m; r0 += kRows) {
        float sum[kRows];
        for (uint32_t s0 = 0; s0 < slabs; s0 += kSlabs) {
            float v[kSlabs][kRows];
#pragma unroll
            for (uint32_t i = 0; i < kSlabs; ++i)
#pragma unroll
                for (uint32_t r = 0; r < kRows; ++r)
                    v[i][r] = s0 + i < slabs && r0 + r < m
                                  ? __ldcg(work + (s0 + i) * slab_stride + static_cast<uint64_t>(r0 + r) * n + col)
                                  : 0.0f;
#pragma unroll
            for (uint32_t i = 0; i < kSlabs; ++i)
#pragma unroll
                for (uint32_t r = 0; r < kRows; ++r)
                    if (s0 + i < slabs) sum[r] = s0 + i == 0 ? v[i][r] : sum[r] + v[i][r];
        }
#pragma unroll
        for (uint32_t r = 0; r < kRows; ++r)
            if (r0 + r < m) c[static_cast<uint64_t>(r0 + r) * n + col] = __float2bfloat16_rn(sum[r]);
    }
}

// The fp8-weight path (m <= 64): work items are (k-slab s, 32-row block b of w), slab-major; CTA i
// of G takes items [i T / G, (i + 1) T / G) and its warp w those of them = w (mod 8), in order.
// Per slab the CTA holds a's rows for that slab in shared memory (loaded after a barrier each time
// the slab changes); each warp streams its items' w through its own cp.async ring of 2 KB stages
// (32 rows x 64 k, 16 bytes a lane: the lane reads back what it copied), which runs on across
// items and slabs. A chunk: the lane's 16 k of each of its 4 w rows, dequantised (one scale byte
// for all four: one 32 x 32 block), against a's same 16 k of rows 8j + g from the slab, in four mma
// m16n8k16. With one slab the item's sums are rounded to c at once; with several each item writes
// its fp32 partial to work[s][row][col] ([slabs][64][n]) and bumps counters[b]; the warp that
// bumps it last sums the slabs' partials in slab order (deterministic whatever the timing), rounds
// to c and sets counters[b] back to 0 for the next launch.
template <uint32_t NT>
__device__ __forceinline__ void fp8w_gemm(const bf16* a, const uint8_t* w, const uint8_t* ws, bf16* c,
                                          uint32_t m, uint32_t n, uint32_t k, uint32_t ks, float* work,
                                          uint32_t* counters) {
    constexpr uint32_t kStageBytes = kSmallWPieces * kPieceBytes;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t kblocks = k / kFp8Block, nblocks = ceil_div(n, kFp8Block);
    const uint32_t slabs = ceil_div(k, ks), cpi = ks / kFp8Chunk, pitch = fp8w_pitch(ks);
    const uint32_t ring = smem_u32(smem_raw) + warp * kFp8Stages * kStageBytes + lane * 16;
    const uint32_t slab = smem_u32(smem_raw) + kFp8RingBytes;
    const uint64_t items = static_cast<uint64_t>(slabs) * nblocks, blocks = grid_blocks();
    const uint64_t start = block_rank() * items / blocks, end = (block_rank() + 1) * items / blocks;
    const uint64_t first = start + (warp + kWarps - start % kWarps) % kWarps;
    const uint32_t mine = first < end ? static_cast<uint32_t>((end - first + kWarps - 1) / kWarps) : 0;
    auto item = [&](uint32_t j) { return first + static_cast<uint64_t>(j) * kWarps; };
    // The loader's cursor: positions are loaded in order (the ring's start, then one refill per
    // position), so it steps through its items' chunks: item lj, chunk lc, this lane's k lkk and
    // first w row's address lsrc there, bit q of lrows: w row g + 8q of the item's block exists.
    uint32_t lj = 0, lc = 0, lkk = 0, lrows = 0;
    const uint8_t* lsrc = w;
    const uint64_t row8 = 8ull * k;
    auto seek = [&](uint32_t j) {
        const uint64_t x = item(j);
        const uint32_t r0 = static_cast<uint32_t>(x % nblocks) * kFp8Block + g;
        lkk = static_cast<uint32_t>(x / nblocks) * ks + 16 * t;
        lrows = 0;
#pragma unroll
        for (uint32_t q = 0; q < kSmallWPieces; ++q) lrows |= (r0 + 8 * q < n ? 1u : 0u) << q;
        lsrc = lrows ? w + r0 * static_cast<uint64_t>(k) + lkk : w;
    };
    auto load = [&](uint32_t stage, uint32_t) {  // w of the next position into `stage`
        const uint32_t dst = ring + stage * kStageBytes;
        const bool kin = lkk < k;
#pragma unroll
        for (uint32_t q = 0; q < kSmallWPieces; ++q) {
            const bool ok = kin && (lrows >> q & 1u);
            cp_async16_l2_256(dst + q * kPieceBytes, ok ? lsrc + q * row8 : w, ok ? 16u : 0u);
        }
        lsrc += kFp8Chunk;
        lkk += kFp8Chunk;
        if (++lc == cpi) {
            lc = 0;
            if (++lj < mine) seek(lj);
        }
    };
    auto scales_of = [&](Fp8ItemScales& sc, uint32_t j) {
        if (j >= mine) return;
        const uint64_t x = item(j);
        sc.load(ws, x % nblocks, static_cast<uint32_t>(x / nblocks) * (ks / kFp8Block), ks / kFp8Block, kblocks, lane);
    };
    const CpAsyncRing<kFp8Stages, kFp8Stages - 1> pipe{mine * cpi};

    Fp8ItemScales cur, next;
    if (mine > 0) seek(0);
    pipe.start(load);  // w and its scales do not depend on the kernel before; a, work and counters may
    scales_of(next, 0);
    pdl_wait();
    uint32_t p = 0;
    const uint32_t s_first = static_cast<uint32_t>(start / nblocks);
    const uint32_t s_end = end > start ? static_cast<uint32_t>((end - 1) / nblocks) + 1 : s_first;
    for (uint32_t s = s_first; s < s_end; ++s) {  // CTA-uniform
        __syncthreads();  // every warp is done with the slab before
        fp8w_load_slab<NT>(a, m, k, s * ks, ks, slab, pitch);
        __syncthreads();
        while (p < mine * cpi) {
            const uint32_t j = p / cpi;
            const uint64_t x = item(j);
            if (x / nblocks != s) break;
            const uint32_t b = static_cast<uint32_t>(x % nblocks);
            cur = next;
            cur.pack();
            scales_of(next, j + 1);
            float acc[2][NT][4];
#pragma unroll
            for (uint32_t i = 0; i < 2; ++i)
#pragma unroll
                for (uint32_t jj = 0; jj < NT; ++jj)
#pragma unroll
                    for (uint32_t e = 0; e < 4; ++e) acc[i][jj][e] = 0.0f;
            const auto chunks = [&](auto twice) {  // the item's chunks, twice an Fp8Twice
                for (uint32_t i = 0; i < cpi; ++i, ++p) {
                    pipe.wait();  // this lane's copies of position p have landed
                    pipe.refill(p, load);
                    const Fp8Scale scale(cur.byte(2 * i + (t >> 1)));
                    const uint32_t src = ring + pipe.stage(p) * kStageBytes;
                    uint4 wv[kSmallWPieces], av[NT][2];
#pragma unroll
                    for (uint32_t q = 0; q < kSmallWPieces; ++q) wv[q] = ld_shared16(src + q * kPieceBytes);
                    const uint32_t arow = slab + g * pitch + (i * kFp8Chunk + 16 * t) * 2;
#pragma unroll
                    for (uint32_t jj = 0; jj < NT; ++jj) {
                        av[jj][0] = ld_shared16(arow + 8 * jj * pitch);
                        av[jj][1] = ld_shared16(arow + 8 * jj * pitch + 16);
                    }
#pragma unroll
                    for (uint32_t q = 0; q < 4; ++q) {  // lane elements 4q .. 4q+3: word q of a w piece
                        uint32_t lo[kSmallWPieces], hi[kSmallWPieces];
#pragma unroll
                        for (uint32_t r = 0; r < kSmallWPieces; ++r) {
                            const uint32_t x4 = q == 0 ? wv[r].x : q == 1 ? wv[r].y : q == 2 ? wv[r].z : wv[r].w;
                            e4m3x4_as_bf16x4(x4, lo[r], hi[r]);
                            lo[r] = scale.apply<decltype(twice)::value>(lo[r]);
                            hi[r] = scale.apply<decltype(twice)::value>(hi[r]);
                        }
#pragma unroll
                        for (uint32_t jj = 0; jj < NT; ++jj) {
                            const uint4 v = av[jj][q / 2];  // a elements 4q .. 4q+3: words 2(q%2), +1
                            const uint32_t b0 = q % 2 == 0 ? v.x : v.z, b1 = q % 2 == 0 ? v.y : v.w;
#pragma unroll
                            for (uint32_t ti = 0; ti < 2; ++ti)  // w rows 16ti + g (piece 2ti) and + 8
                                mma_bf16(acc[ti][jj], lo[2 * ti], lo[2 * ti + 1], hi[2 * ti], hi[2 * ti + 1], b0, b1);
                        }
                    }
                }
            };
            if (__any_sync(0xffffffffu, fp8_any_twice(cur.lo, cur.hi))) chunks(Fp8Twice<true>{});
            else chunks(Fp8Twice<false>{});
            // acc[ti][jj]: e0 (w row 16ti+g, a row 8jj+2t), e1 (a row +1), e2/e3 (w row +8): to c
            // at once (one slab), else to this slab's partials.
            float* part = work + static_cast<uint64_t>(s) * kFp8MaxRows * n;
#pragma unroll
            for (uint32_t ti = 0; ti < 2; ++ti)
#pragma unroll
                for (uint32_t jj = 0; jj < NT; ++jj)
#pragma unroll
                    for (uint32_t e = 0; e < 4; ++e) {
                        const uint32_t row = 8 * jj + 2 * t + (e & 1), col = b * kFp8Block + 16 * ti + g + 8 * (e >> 1);
                        if (row >= m || col >= n) continue;
                        const uint64_t at = static_cast<uint64_t>(row) * n + col;
                        if (slabs == 1) c[at] = __float2bfloat16_rn(acc[ti][jj][e]);
                        else __stcg(part + at, acc[ti][jj][e]);
                    }
            if (slabs == 1) continue;
            __threadfence();  // the partial is visible before the count says so
            __syncwarp();
            uint32_t before = 0;
            if (lane == 0) before = atomicAdd(counters + b, 1u);
            if (__shfl_sync(0xffffffffu, before, 0) != slabs - 1) continue;
            __threadfence();  // every other slab's partial, counted, is visible now
            const uint32_t col = b * kFp8Block + lane;
            if (col < n) fp8w_sum_slabs(work, c, m, n, col, slabs);
            if (lane == 0) counters[b] = 0;
        }
    }
    cp_async_wait<0>();
}

}  // namespace gemm
