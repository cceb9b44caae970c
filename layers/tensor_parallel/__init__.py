"""Tensor parallelism for the n-gram embedding: tables and word rows split over a group of GPUs,
one all-reduce per call (``layer``; ``decoder`` with the token history on the device), over NCCL (``nccl``, the ``multi-gpu`` extra: imported only
when used) or, every rank on one device, ``LocalGroup``."""

from .collective import Collective, CollectiveGroup, LocalGroup
from .decoder import TensorParallelNgramDecoder
from .layer import RankWeights, TensorParallelNgramEmbedding, embed_all
from .shard import NgramShard, reduce_bytes

__all__ = ["Collective", "CollectiveGroup", "LocalGroup", "NgramShard", "RankWeights",
           "TensorParallelNgramDecoder", "TensorParallelNgramEmbedding", "embed_all", "reduce_bytes"]
