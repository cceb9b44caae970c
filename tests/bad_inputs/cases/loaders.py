"""The loaders' cases: model folders for ``from_pretrained`` and PEFT adapter folders for
``overlay_from_peft``; each case damages a fresh copy, then loads it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from layers.ngram_embed import NgramEmbedding
from layers.ngram_embed.checkpoint import CheckpointError
from layers.peft_adapter import PeftAdapterError, overlay_from_peft
from tests.bad_inputs.matrix import case
from tests.bad_inputs.world import World
from tests.helpers.checkpoint import PROJ, TABLE, rewrite_tensor
from tests.helpers.peft import EMBED, token_rows

CPU_CASES = [
    case("from_pretrained", "dtype", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, TABLE.format(0), m.tables[0][0].astype(np.float32))).path, w.gpu),
         CheckpointError, "is F32: tables are served as bf16 or fp8"),
    case("from_pretrained", "dtype",
         lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu, max_tokens=2.0),
         TypeError, "max_tokens must be an int", detail="max_tokens"),
    case("from_pretrained", "shape", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, PROJ.format(0), np.ascontiguousarray(m.projs[0].T))).path, w.gpu),
         CheckpointError, r"post_projs.0.weight' has shape \[6, 24\]"),
    case("from_pretrained", "length", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu,
                                                                               placement=["device"] * 3),
         ValueError, "3 entries for 4 tables"),
    case("from_pretrained", "range", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu, eos_id=300),
         CheckpointError, "eos_id must be in 0..V-1"),
    case("from_pretrained", "range", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu, placement="gpu"),
         ValueError, "placement must be", detail="placement"),
    case("from_pretrained", "null", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, TABLE.format(2), None)).path, w.gpu),
         CheckpointError, "no tensor 'model.ngram_embeddings.embedders.2.weight'"),
    case("from_pretrained", "empty", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: (m.path / "config.json").unlink()).path, w.gpu), CheckpointError, "no config.json"),
    case("overlay_from_peft", "dtype", lambda w: overlay_from_peft(w.adapter(
        {f"{EMBED}.trainable_tokens_delta": np.ones((2, 16), np.int32)}), vocab=64),
         PeftAdapterError, "not a float type"),
    case("overlay_from_peft", "shape", lambda w: overlay_from_peft(w.adapter(
        {f"{EMBED}.trainable_tokens_delta": token_rows(w.rng, 3)}), vocab=64),
         PeftAdapterError, r"expected \[2, h\]"),
    case("overlay_from_peft", "id", lambda w: overlay_from_peft(w.adapter(ids=[3, 64]), vocab=64),
         PeftAdapterError, "token id 64 .* outside"),
    case("overlay_from_peft", "empty", lambda w: overlay_from_peft(w.empty_dir("adapter"), vocab=64),
         FileNotFoundError, "adapter_config.json"),
    case("overlay_from_peft", "null", lambda w: overlay_from_peft(w.tmp / "no-adapter", vocab=64),
         FileNotFoundError, "does not exist"),
]


def _after_from_pretrained(w: World) -> None:
    model = w.model()
    layer = NgramEmbedding.from_pretrained(model.path, w.gpu)
    assert layer.dims == model.dims and len(layer.tables) == model.dims.num_tables()
    layer.close()


def _after_peft(w: World) -> None:
    overlay = overlay_from_peft(w.adapter(ids=[5, 9]), vocab=64)
    assert overlay.embed.ids.tolist() == [5, 9]


AFTER: dict[str, Callable[[World], None]] = {
    "from_pretrained": _after_from_pretrained,
    "overlay_from_peft": _after_peft,
}
