"""Greedy decoding in which the host only launches CUDA graphs: one graph per step.

A small random model with tied embeddings (V = 32000, D = 1024, n-grams up to N = 3, K = 2
splits: T = 4 tables) stands in for an LM. Each step is one captured graph of
  embed_from_argmax(logits)  -> the ids, written straight into the buffer NgramDecoder.step reads
  NgramDecoder.step(ids)     -> hidden [B, D] (n-gram embedding; the token history stays on the GPU)
  LM head hidden @ word^T    -> logits [B, V], read by the next step's argmax.
B = 4 sequences are prefilled from random prompts with dec.prefill. Step 0 runs eagerly (it
loads kernels and sets shared-memory limits, which a capture must not do), then the captured
step is replayed 32 times. The ids stay on the device (a shift register in the graph) until one
copy at the end; the first CHECK steps are compared with a numpy re-run of the loop.
Needs a CUDA GPU and the package installed (``pip install .``): python examples/greedy_decode.py
"""

import argparse
import sys

from _requires import installed  # examples/_requires.py: a missing package is one line

with installed("greedy_decode.py"):
    import ml_dtypes
    import numpy as np

    from gpu_runtime import CudaBackend, DeviceArray, NoDeviceError, cli
    from layers.kernel_files import load_kernel
    from layers.ngram_embed import NgramDecoder, NgramDims, NgramWeights, ngram_ids_tail
    from layers.ops import ArgmaxEmbed, dense_gemm_bf16_pipelined

BF16 = np.dtype(ml_dtypes.bfloat16)
V, D, B, PROMPT, STEPS, CHECK = 32000, 1024, 4, 16, 32, 4
DIMS = NgramDims(vocab_size=V, hidden_size=D, max_ngram=3, splits=2, base_rows=1 << 16)
T, TD = DIMS.num_tables(), DIMS.table_dim()


def randn(rng, shape, scale):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def reference_ids(word, tables, projs, prompts, steps):
    """The same loop in numpy, ``[steps, B]``: each context's last token embedded as the fused
    path does (its T table rows through their projections, summed exactly, plus its word row in
    fp32, times 1/(1+T), one rounding to bf16), logits bf16(h @ word^T), lowest-index argmax."""
    inv = np.float32(1.0) / np.float32(1 + T)
    word64 = word.astype(np.float64)
    contexts, out = [list(p) for p in prompts], []
    for _ in range(steps):
        ids = []
        for c in contexts:
            rows = [table[i] for table, i in zip(tables, ngram_ids_tail(DIMS, c, 1))]  # [1, TD] each
            acc = sum(r.astype(np.float64) @ p.astype(np.float64).T for r, p in zip(rows, projs))
            h = ((acc.astype(np.float32) + word[c[-1]].astype(np.float32)) * inv).astype(BF16)
            logits = (h.astype(np.float64) @ word64.T).astype(np.float32).astype(BF16)
            ids.append(int(np.argmax(logits[0].astype(np.float32))))  # the first of equal maxima
        for c, i in zip(contexts, ids):
            c.append(i)
        out.append(ids)
    return np.array(out, np.uint32)


def main():
    cli.ArgumentParser(
        prog="greedy_decode.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help, and a usage error for any other argument
    rng = np.random.default_rng(0)
    word = randn(rng, (V, D), 1.0)
    tables = [randn(rng, (DIMS.table_rows(c), TD), 1.0) for c in range(T)]
    # Projections large enough that the n-grams, not the token's own (tied) row, pick the argmax.
    projs = [randn(rng, (D, TD), 0.5) for _ in range(T)]
    prompts = rng.integers(0, V, (B, PROMPT), dtype=np.uint32)
    with CudaBackend() as gpu:
        s = gpu.create_stream()
        weights = NgramWeights.from_numpy(DIMS, word, tables, projs, gpu, stream=s)
        dec = NgramDecoder(weights, max_seqs=B, max_rows=B * PROMPT, stream=s)
        argmax = ArgmaxEmbed(
            gpu, load_kernel(gpu, "embed_from_argmax", "embed_from_argmax_bf16"), weights.word.weight, V, D
        )
        gemm_k = load_kernel(gpu, "gemm", "dense_gemm_bf16_pipelined")
        empty = lambda shape, dtype: DeviceArray.empty(gpu, shape, dtype, s)  # noqa: E731
        prompt_d = DeviceArray.from_numpy(gpu, prompts.reshape(-1), s)
        cu_seqlens = DeviceArray.from_numpy(gpu, np.arange(B + 1, dtype=np.uint32) * PROMPT, s)
        slots = DeviceArray.from_numpy(gpu, np.arange(B, dtype=np.uint32), s)
        prefill_out, hidden = empty((B * PROMPT, D), BF16), empty((B, D), BF16)
        word_rows, logits, tokens = empty((B, D), BF16), empty((B, V), BF16), empty((B,), np.uint32)
        gen, shift = empty((STEPS + 1, B), np.uint32).fill_bytes(0), empty((STEPS + 1, B), np.uint32)

        def lm_head():  # tied embeddings: the word table [V, D] is the LM head's weight
            dense_gemm_bf16_pipelined(gpu, gemm_k, hidden.ptr, weights.word, logits.ptr, B, V, D, s)

        for slot in range(B):  # new requests: empty histories
            dec.reset(slot, s)
        dec.prefill(prompt_d, cu_seqlens, slots, B, B * PROMPT, prefill_out.ptr, s)
        # Each prompt's last row (a pitched copy) through the LM head: the first logits.
        gpu.copy_2d_async(hidden.ptr, D * 2, prefill_out.ptr.offset((PROMPT - 1) * D * 2), PROMPT * D * 2, D * 2, B, s)
        lm_head()

        def step():
            argmax.run(logits.ptr, word_rows.ptr, tokens.ptr, B, s)  # word_rows: unused plain embedding
            # gen <- gen[1:] ++ tokens: the same graph every step, yet every step's ids are kept
            gpu.copy_d2d_async(shift.ptr, gen.ptr.offset(B * 4), STEPS * B * 4, s)
            gpu.copy_d2d_async(shift.ptr.offset(STEPS * B * 4), tokens.ptr, B * 4, s)
            gpu.copy_d2d_async(gen.ptr, shift.ptr, (STEPS + 1) * B * 4, s)
            dec.step(tokens, slots, B, hidden.ptr, s)
            lm_head()

        step()  # step 0, eagerly
        gpu.begin_capture(s)
        try:
            step()
        except BaseException:
            gpu.abort_capture(s)
            raise
        graph = gpu.end_capture(s)
        for _ in range(STEPS):
            gpu.launch_graph(graph, s)
        ids = gen.to_numpy()  # [STEPS + 1, B]: the only copy back (waits for the stream)
        print(f"decoder errors: {dec.check_errors()!r}")
        for i in range(B):
            print(f"seq {i}: prompt ...{prompts[i, -3:].tolist()} -> {ids[:, i].tolist()}")
        want = reference_ids(word, tables, projs, prompts, CHECK)
        if np.array_equal(ids[:CHECK], want):
            print(f"first {CHECK} steps match the numpy re-run")
        else:  # a 1-ulp difference in the embedding can flip a near-tie of two bf16 logits
            print(f"MISMATCH, first {CHECK} steps:\n gpu   {ids[:CHECK].tolist()}\n numpy {want.tolist()}")
        dec.close()
        weights.close()  # after the decoder; the backend frees the graph and the buffers on leaving the block


if __name__ == "__main__":
    try:
        main()
    except NoDeviceError as exc:  # one line, not a traceback
        sys.exit(f"greedy_decode.py needs a CUDA GPU (examples/cpu_reference.py runs without one): {exc}")
