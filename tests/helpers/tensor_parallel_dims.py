"""The tensor-parallel tests' shared dims (test_tensor_parallel_shards.py,
test_tensor_parallel_runners.py): ``tp_dims``, small dims of T = 4 tables, V = 500, D = 40."""

from __future__ import annotations

from tests.helpers.ngram import small_dims


def tp_dims(**kw):
    return small_dims(max_ngram=3, splits=2, **kw)  # T = 4 tables, V = 500, D = 40
