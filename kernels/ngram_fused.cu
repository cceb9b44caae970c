// Fused n-gram hash and gather: every table's id computed from the tokens on the GPU, and every
// table's row copied into one [R, T*td] bf16 buffer that a single GEMM then consumes.
//
// Why this shape:
// * One warp per (output row r, table c) pair, grid-strided so any R*T fits a capped grid, in
//   table-major order i = c*R + r: the warps in flight read one table at a time, which keeps a
//   host-memory table's pages within the GPU's TLB reach (NgramTable.Host, whose launches give
//   each warp one pair: pair_launch in layers/ops/ngram_fused.py). Out row r is the T gathered
//   rows side by side, each warp writing one td piece.
// * The hash and the row copy are ngram_hash.cuh's, shared with ngram_decode.cu (vector paths
//   when td and the addresses allow, element-wise otherwise; fp8 dequantised with one rounding).
// * Cached tables (flag bit 0) take their row from slots[r*T + c] instead of the hash: their rows
//   live in a row-cache arena, not in a table of M_c rows.
//
// The kernel cannot see a table's size: the host guarantees 1 <= M_c < 2**32 rows per hashed
// table and in-range slots for cached ones.
#include "ngram_hash.cuh"

// out[r, c*td + j] = row id_c(r) of table c, element j; ids_out[r*T + c] = id_c(r) when given.
extern "C" __global__ void ngram_gather(const uint32_t* windows, const uint64_t* tables,
                                        const uint64_t* pows, const uint32_t* slots, bf16* out,
                                        uint32_t* ids_out, uint32_t rows_r, uint32_t num_tables,
                                        uint32_t max_ngram, uint32_t splits, uint32_t td,
                                        uint32_t eos) {
    pdl_launch_dependents();  // the GEMM may start streaming its weights (it waits for our rows)
    const uint32_t lane = threadIdx.x % ngram::kWarp;
    const uint64_t warps = static_cast<uint64_t>(gridDim.x) * blockDim.x / ngram::kWarp;
    const uint64_t first = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / ngram::kWarp;
    // warp-uniform: the hash's ballots see all 32 lanes
    for (ngram::PairWalk pair(first, warps, rows_r); pair.c < num_tables; pair.next()) {
        const uint32_t c = static_cast<uint32_t>(pair.c);
        const uint64_t r = pair.r;
        const uint64_t rc = r * num_tables + c;  // the pair's place in [R, T] (slots, ids_out, out)
        const ngram::Table t = ngram::load_table(tables, c);
        const uint32_t* w = windows + r * max_ngram;
        const uint32_t id = t.cached()
            ? __ldg(slots + rc)
            : ngram::hash_id([w](uint32_t d) { return __ldg(w + d); },
                             pows + static_cast<uint64_t>(c) * max_ngram, c / splits + 2, t.rows,
                             eos, lane);
        if (ids_out != nullptr && lane == 0) ids_out[rc] = id;
        ngram::copy_table_row(t, id, out + rc * td, td, lane);
    }
}
