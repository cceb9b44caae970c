// Part of gemm.cu (included after its sizes): how the tensor-core paths (small, tiled, wgmma) get
// their operands into shared memory.
//
//   load_slot      one 16-byte slot <- elements kk .. kk+7 of a K-major row: fast loads are one
//                  cp.async (zero-filled past the edges), slow loads eight bounds-checked scalar
//                  loads stored to the same slot, so the compute code is shared;
//   row_sources    the rows of one operand a thread copies, each checked once per work item, and
//   load_rows      a stage's 16-byte slots of them;
//   TileLoader     the stage loader of the tiled and wgmma paths (a CTA tile's rows of a and w);
//   CpAsyncRing    the multi-stage pipeline each path's K loop runs: kStages shared-memory stages,
//                  filled kAhead k-tiles ahead of the one being consumed.
#pragma once
#include "gemm_common.cuh"

namespace gemm {

// Elements kk .. kk+7 of one row, zero past k: the loader for unaligned rows or k % 8 != 0.
__device__ __forceinline__ uint4 load8_scalar(const bf16* row, uint32_t kk, uint32_t k) {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row);
    uint32_t e[8];
#pragma unroll
    for (uint32_t j = 0; j < 8; ++j) e[j] = (kk + j < k) ? static_cast<uint32_t>(__ldg(p + kk + j)) : 0u;
    return make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16),
                      e[6] | (e[7] << 16));
}

// Which loads a loader runs, as a type: each k-step branches once on the uniform `fast` and then
// runs code compiled for that case.
template <bool kFast>
struct LoadKind {
    static constexpr bool value = kFast;
};

template <class F>
__device__ __forceinline__ void with_load_kind(bool fast, const F& f) {
    if (fast) f(LoadKind<true>{});
    else f(LoadKind<false>{});
}

// One 16-byte slot of shared memory <- elements kk .. kk+7 of `row`, or zeros when !ok.
// Fast: cp.async (src-size 0 zero-fills and reads nothing; `row` is then any valid address).
__device__ __noinline__ void load_slot_scalar(uint32_t dst, const bf16* row, bool ok, uint32_t kk,
                                              uint32_t k) {
    st_shared16(dst, ok ? load8_scalar(row, kk, k) : make_uint4(0u, 0u, 0u, 0u));
}

template <bool kFast>
__device__ __forceinline__ void load_slot(uint32_t dst, const bf16* row, bool ok, uint32_t kk,
                                          uint32_t k) {
    if (kFast) {
        cp_async16(dst, ok ? row + kk : row, ok ? 16u : 0u);
    } else {
        load_slot_scalar(dst, row, ok, kk, k);
    }
}

// The kRows rows row0, row0 + stride, ... of a K-major [rows, k] operand that one thread copies:
// src[i] the row, ok[i] whether it exists (a missing row points at row 0 with a zero-fill
// predicate, so no load reads past the operand). Arrays of the caller, not members of a struct:
// NVVM then allocates registers as it did for the hand-written loaders.
template <uint32_t kRows>
__device__ __forceinline__ void row_sources(const bf16* base, uint32_t row0, uint32_t stride,
                                            uint32_t rows, uint32_t k, const bf16* (&src)[kRows],
                                            bool (&ok)[kRows]) {
#pragma unroll
    for (uint32_t i = 0; i < kRows; ++i) {
        const uint32_t r = row0 + i * stride;
        ok[i] = r < rows;
        src[i] = base + static_cast<uint64_t>(ok[i] ? r : 0) * k;
    }
}

// Slot i (at dst + i * pitch) <- elements kk .. kk+7 of row src[i]; zeros for a missing row or
// when !kin (kin = kk < k, which the caller computes once for all the rows of a stage).
template <class Kind, uint32_t kRows>
__device__ __forceinline__ void load_rows(Kind, const bf16* const (&src)[kRows],
                                          const bool (&ok)[kRows], uint32_t dst, uint32_t pitch,
                                          uint32_t kk, bool kin, uint32_t k) {
#pragma unroll
    for (uint32_t i = 0; i < kRows; ++i)
        load_slot<Kind::value>(dst + i * pitch, src[i], ok[i] && kin, kk, k);
}

// The stage loader of the tiled and wgmma paths: k-tile kt of the CTA tile at (m0, n0), BM rows
// of a and BN rows of w, into one stage (the a rows, then the w rows, Layout::kRowBytes each,
// 16-byte chunk ch of row r at byte Layout::offset(r, ch)). Thread tid copies chunk
// tid % kChunks of rows tid / kChunks + kRowsPerPass * i; the layout gives those rows the same
// swizzle, so one offset (slot(tid), taken once per thread) serves every pass. The tile's rows are
// the caller's arrays (row_sources per tile), held by reference.
template <uint32_t BM, uint32_t BN, class Layout>
struct TileLoader {
    // (enumerators: NVRTC would emit static constexpr members as device globals)
    enum : uint32_t {
        kRowBytes = Layout::kRowBytes,
        kK = kRowBytes / 2,  // k per tile
        kChunks = kRowBytes / 16,
        kRowsPerPass = kThreads / kChunks,
        kABytes = BM * kRowBytes,
        kStageBytes = (BM + BN) * kRowBytes,
        kALoads = BM / kRowsPerPass,  // rows of a, and of w, per thread
        kBLoads = BN / kRowsPerPass,
    };
    static_assert(BM % kRowsPerPass == 0 && BN % kRowsPerPass == 0, "tile rows per pass");

    // This thread's place in a stage: the first of its rows, its chunk and that chunk's offset.
    struct Slot {
        uint32_t row, ch, off;
    };
    __device__ __forceinline__ static Slot slot(uint32_t tid) {
        const uint32_t ch = tid % kChunks, row = tid / kChunks;
        return Slot{row, ch, Layout::offset(row, ch)};
    }

    const bf16* const (&a_src)[kALoads];  // this tile's rows (row_sources from slot().row)
    const bool (&a_ok)[kALoads];
    const bf16* const (&w_src)[kBLoads];
    const bool (&w_ok)[kBLoads];
    uint32_t base;  // shared-memory address of stage 0
    Slot me;
    uint32_t k;
    bool fast;

    __device__ __forceinline__ void operator()(uint32_t stage, uint32_t kt) const {
        with_load_kind(fast, [&](auto kind) {
            const uint32_t kk = kt * kK + me.ch * 8;
            const bool kin = kk < k;
            const uint32_t sa = base + stage * kStageBytes + me.off, sb = sa + kABytes;
            load_rows(kind, a_src, a_ok, sa, kRowsPerPass * kRowBytes, kk, kin, k);
            load_rows(kind, w_src, w_ok, sb, kRowsPerPass * kRowBytes, kk, kin, k);
        });
    }
};

// A ring of kStages shared-memory stages that cp.async fills kAhead k-tiles ahead of the one
// being consumed. One commit group per k-tile (empty ones too), so waiting for k-tile kt is
// waiting until at most kAhead - 1 groups are pending. load(stage, kt) issues k-tile kt's copies.
// kAhead = kStages - 1 refills the stage consumed in the iteration before (free once every
// thread has passed a barrier, or at once where each thread reads only its own copies);
// kAhead = kStages - 2 leaves one stage for asynchronous readers (wgmma) still in flight.
template <uint32_t kStages, uint32_t kAhead>
struct CpAsyncRing {
    static_assert(0 < kAhead && kAhead < kStages, "stages ahead");
    uint32_t tiles;  // k-tiles in all

    __device__ __forceinline__ static uint32_t stage(uint32_t kt) { return kt % kStages; }

    // The prologue: k-tiles 0 .. kAhead-1 (a loop, not unrolled: it runs once per tile, and
    // every copy of the loader is code a cold instruction cache has to fetch).
    template <class Load>
    __device__ __forceinline__ void start(const Load& load) const {
#pragma unroll 1
        for (uint32_t s = 0; s < kAhead; ++s) {
            if (s < tiles) load(s, s);
            cp_async_commit();
        }
    }

    // Until this thread's copies of k-tile kt (the oldest one not waited for) have landed.
    __device__ __forceinline__ void wait() const { cp_async_wait<kAhead - 1>(); }

    // Request k-tile kt + kAhead, if any, into its stage.
    template <class Load>
    __device__ __forceinline__ void refill(uint32_t kt, const Load& load) const {
        // next % kStages written out: through stage(next), NVVM picks another loop counter for the
        // tiled path than its hand-written loop had.
        const uint32_t next = kt + kAhead;
        if (next < tiles) load(next % kStages, next);
        cp_async_commit();
    }
};

}  // namespace gemm
