"""Tensor parallelism for the n-gram embedding: tables and word rows split over a group of GPUs,
one all-reduce per call (``layer``), over NCCL (``nccl``, the ``multi-gpu`` extra: imported only
when used) or, every rank on one device, ``LocalGroup``."""

from .collective import Collective, CollectiveGroup, LocalGroup
from .layer import RankWeights, TensorParallelNgramEmbedding, embed_all
from .shard import NgramShard, reduce_bytes

__all__ = ["Collective", "CollectiveGroup", "LocalGroup", "NgramShard", "RankWeights",
           "TensorParallelNgramEmbedding", "embed_all", "reduce_bytes"]
