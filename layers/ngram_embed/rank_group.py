"""``embed_all``: one process driving every rank of a tensor-parallel group, each a
``FusedNgramEmbedding`` over its shard's ``NgramWeights``: every rank stages its rows, the group
sums the buffers (``layers.tensor_parallel.CollectiveGroup``: NCCL group calls, or ``LocalGroup``
with every rank on one device), every rank projects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_runtime import validate

from ..tensor_parallel import check_group, check_rank_shard
from .fused import FusedNgramEmbedding
from .runner_checks import out_address


def embed_all(
    group: Any,
    ranks: Sequence[FusedNgramEmbedding],
    contexts: Sequence[Any],
    seq_lens: Sequence[int],
    outs: Sequence[Any],
    streams: Sequence[int],
) -> int:
    """Rank r embeds the batch into ``outs[r]`` on ``streams[r]`` (every rank's output is the
    same, the single-GPU fused path's). Returns the rows. Everything is checked before any upload."""
    check_group("embed_all", group)
    if not (len(ranks) == len(outs) == len(streams) == group.size):
        raise ValueError(
            f"embed_all: {len(ranks)} ranks, {len(outs)} outs and {len(streams)} streams for a group of {group.size}"
        )
    streams = [validate.stream(s, f"embed_all: streams[{r}]") for r, s in enumerate(streams)]
    for r, rank in enumerate(ranks):
        if not isinstance(rank, FusedNgramEmbedding):
            raise TypeError(f"embed_all: ranks[{r}] is a {type(rank).__name__}, not a FusedNgramEmbedding")
        check_rank_shard("embed_all", r, rank.weights.shard, group.size)
        if rank.dims != ranks[0].dims:
            raise ValueError(f"embed_all: ranks[{r}] has other dims than rank 0")
        validate.require_open(rank.closed, f"embed_all: ranks[{r}]")
        validate.require_open(rank.weights.closed, f"embed_all: ranks[{r}]'s NgramWeights")
    rows = ranks[0].windows(contexts, seq_lens).shape[0]  # every rank's check then passes: same dims
    if rows > ranks[0].max_rows:
        raise ValueError(f"embed_all: {rows} rows over max_rows {ranks[0].max_rows}")
    addresses = [
        out_address(out, "embed_all", rows, rank.dims, rank.gpu) if rows else 0 for rank, out in zip(ranks, outs)
    ]
    for rank, s in zip(ranks, streams):
        rank.stage(contexts, seq_lens, s)
    if rows:
        group.allreduce_bf16_all(
            [(int(rank.projection.buf), rank.projection.reduce_count(rows), s) for rank, s in zip(ranks, streams)]
        )
        for rank, out, s in zip(ranks, addresses, streams):
            rank.project(rows, out, s)
    return rows
