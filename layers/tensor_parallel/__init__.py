"""The collectives tensor parallelism needs: a bf16 sum all-reduce, per rank (``Collective``, for
one process per GPU) or for every rank of this process (``CollectiveGroup``); ``LocalGroup`` runs
every rank on one device, and ``layers.tensor_parallel.nccl`` provides both over NCCL (the
``multi-gpu`` extra, imported only when used). A shard's ``NgramWeights`` (``shard=``) and
``collective=`` on ``FusedNgramEmbedding`` / ``NgramDecoder`` use them."""

from .collective import Collective, CollectiveGroup, LocalGroup, check_collective, check_group, check_rank_shard

__all__ = ["Collective", "CollectiveGroup", "LocalGroup", "check_collective", "check_group", "check_rank_shard"]
