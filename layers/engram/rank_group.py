"""``lookup_all``: one process driving every rank of a tensor-parallel group, each an
``EngramDecoder`` over its shard's ``EngramWeights``: every rank gathers the rows it holds, the
group sums the ``emb`` buffers (``layers.tensor_parallel.CollectiveGroup``: NCCL group calls, or
``LocalGroup`` with every rank on one device), every rank projects. Each rank's ``kv`` is then the
single-GPU decoder's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_runtime import validate

from ..tensor_parallel import check_group, check_rank_shard
from .decoder import EngramDecoder


def lookup_all(
    group: Any,
    ranks: Sequence[EngramDecoder],
    tokens: Sequence[Any],
    cu_seqlens: Sequence[Any],
    slots: Sequence[Any],
    num_seqs: int,
    num_tokens: int,
    streams: Sequence[int],
) -> None:
    """``prefill`` on every rank: rank r reads its own ``tokens[r]``, ``cu_seqlens[r]`` and
    ``slots[r]`` (device buffers on its device, the same values on every rank) on ``streams[r]``.
    Everything is checked before the first launch."""
    check_group("lookup_all", group)
    per_rank = {"ranks": ranks, "tokens": tokens, "cu_seqlens": cu_seqlens, "slots": slots, "streams": streams}
    for name, given in per_rank.items():
        if not isinstance(given, Sequence):
            raise TypeError(f"lookup_all: {name} must be a sequence, one entry per rank, got {type(given).__name__}")
    if not (len(ranks) == len(tokens) == len(cu_seqlens) == len(slots) == len(streams) == group.size):
        raise ValueError(f"lookup_all: every per-rank sequence needs {group.size} entries, one a rank")
    streams = [validate.stream(s, f"lookup_all: streams[{r}]") for r, s in enumerate(streams)]
    calls = []
    for r, rank in enumerate(ranks):
        if not isinstance(rank, EngramDecoder):
            raise TypeError(f"lookup_all: ranks[{r}] is a {type(rank).__name__}, not an EngramDecoder")
        check_rank_shard("lookup_all", r, rank.weights.shard, group.size)
        if rank.collective is not None:
            raise ValueError(f"lookup_all: ranks[{r}] has a collective of its own; the group sums here")
        n_seqs, rows = rank._sizes(num_seqs, num_tokens)
        calls.append((rank._ragged(tokens[r], cu_seqlens[r], slots[r], n_seqs, rows), rank._ready(streams[r])))
        if rows:
            rank._projections(rows)  # planned before the first launch
    if num_tokens == 0:
        return
    for rank, (indices, s) in zip(ranks, calls):
        rank.gather(indices, 0, num_seqs, num_tokens, 0, s)
    emb = ranks[0].config.emb_dim
    for i in range(len(ranks[0].config.layer_ids)):
        group.allreduce_bf16_all([(rank.emb_of(i), num_tokens * emb, s) for rank, s in zip(ranks, streams)])
    for rank, s in zip(ranks, streams):
        rank.project(num_tokens, s)
