"""``overlay_from_peft``: PEFT adapter folders written here in PEFT's published format
(``adapter_config.json`` with the real keys, ``adapter_model.safetensors`` with the real tensor
names, float32, ``{"format": "pt"}`` metadata as ``safetensors.torch.save_file`` writes it):
trainable tokens standalone and inside LoRA (list and per-module dict), tied embeddings with both
tensors saved and with one, ``modules_to_save`` copies through ``build_overlay`` (on the
host-memory backend with ``embed_rowdiff`` emulated, and once on the GPU), and every refusal.
Expected overlays are built here from the arrays written, compared bit for bit."""

from __future__ import annotations

import json
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import KernelNotFoundError
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import AdapterOverlay
from layers.peft_adapter import PeftAdapterError, overlay_from_peft, read_peft_adapter
from layers.dense_weight import DenseWeight
from tests.helpers import bits, random_bf16
from tests.helpers.overlay import overlay_backend
from tests.helpers.peft import EMBED, H, LM, P, save_adapter, token_rows, tt_config

BF16 = np.dtype(ml_dtypes.bfloat16)
VOCAB = 64


# -- writing adapters as PEFT does -----------------------------------------------------------------

def lora_config(**over: Any) -> dict:
    """``LoraConfig(...).to_dict()`` as ``save_pretrained`` writes it (peft 0.17 keys)."""
    cfg = {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": "tiny/llama-test",
        "bias": "none", "corda_config": None, "eva_config": None, "exclude_modules": None,
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
        "loftq_config": {}, "lora_alpha": 16, "lora_bias": False, "lora_dropout": 0.0,
        "megatron_config": None, "megatron_core": "megatron.core", "modules_to_save": None,
        "peft_type": "LORA", "qalora_group_size": 16, "r": 4, "rank_pattern": {}, "revision": None,
        "target_modules": ["v_proj", "q_proj"], "target_parameters": None, "task_type": "CAUSAL_LM",
        "trainable_token_indices": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
    }
    cfg.update(over)
    return cfg


def attention_lora(rng, layers: int = 2, r: int = 4) -> dict[str, np.ndarray]:
    out = {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            base = f"{P}model.layers.{i}.self_attn.{proj}"
            out[f"{base}.lora_A.weight"] = rng.standard_normal((r, H)).astype(np.float32)
            out[f"{base}.lora_B.weight"] = np.zeros((H, r), np.float32)
    return out


def check_table(table, ids, rows_f32) -> None:
    """``table`` holds exactly ``ids`` (any order) with ``rows_f32`` rounded to bf16."""
    ids = np.asarray(ids)
    order = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(table.ids, ids[order])
    assert table.ids.dtype == np.int32 and table.rows.dtype == BF16
    np.testing.assert_array_equal(bits(table.rows), bits(np.asarray(rows_f32)[order].astype(BF16)))


def changed_rows(adapter_f32: np.ndarray, served: np.ndarray) -> np.ndarray:
    """The rows whose bf16 rounding differs from the served bf16 row (thresh 0, no NaN/zeros)."""
    return np.flatnonzero((bits(adapter_f32.astype(BF16)) != bits(served)).any(axis=1))


def served_copy(rng, served: np.ndarray, rows: list[int]) -> np.ndarray:
    """A float32 ``modules_to_save`` copy of ``served`` with ``rows`` retrained, plus rows nudged
    by less than half a bf16 ulp (they round back: not served)."""
    out = served.astype(np.float32)
    out[rows] = rng.standard_normal((len(rows), served.shape[1])).astype(np.float32) * 3
    nudged = [r for r in range(served.shape[0]) if r not in rows][:3]
    out[nudged] *= np.float32(1 + 2.0 ** -12)
    return out


# -- trainable tokens, standalone ----------------------------------------------------------------

@pytest.mark.parametrize("prefix", [P, ""], ids=["peft_model", "transformers_integration"])
def test_standalone_untied(tmp_path, rng, prefix):
    ids = [40, 3, 17, 63]
    rows = token_rows(rng, 4)
    d = save_adapter(tmp_path / "a", tt_config(ids),
                     {f"{prefix}model.embed_tokens.trainable_tokens_delta": rows})
    ov = overlay_from_peft(d, vocab=VOCAB)
    assert isinstance(ov, AdapterOverlay)
    check_table(ov.embed, ids, rows)
    assert ov.lm_head is None                         # PEFT saves the tied LM head's rows: untied
    ad = read_peft_adapter(d, vocab=VOCAB)
    assert ad.peft_type == "TRAINABLE_TOKENS" and ad.tied is False and ad.h == H
    assert ad.embed.modules == ("model.embed_tokens",) and ad.other_modules == ()
    # the caller's word wins
    assert overlay_from_peft(d, vocab=VOCAB, tied=True).lm_head is not None


def test_standalone_tied_both_tensors(tmp_path, rng):
    """peft (v0.15 - 0.21) saves the shared rows under the embedding and the tied LM head."""
    ids = [5, 9, 1]
    rows = token_rows(rng, 3)
    d = save_adapter(tmp_path / "a", tt_config(ids), {f"{EMBED}.trainable_tokens_delta": rows,
                                                      f"{LM}.trainable_tokens_delta": rows.copy()})
    for tied in (None, True, False):
        ov = overlay_from_peft(d, vocab=VOCAB, tied=tied)
        check_table(ov.embed, ids, rows)
        check_table(ov.lm_head, ids, rows)


def test_standalone_two_targets_untied(tmp_path, rng):
    ids = [2, 30]
    emb, lm = token_rows(rng, 2), token_rows(rng, 2)
    d = save_adapter(tmp_path / "a", tt_config(ids, ["embed_tokens", "lm_head"]),
                     {f"{EMBED}.trainable_tokens_delta": emb, f"{LM}.trainable_tokens_delta": lm})
    ov = overlay_from_peft(d, vocab=VOCAB)
    check_table(ov.embed, ids, emb)
    check_table(ov.lm_head, ids, lm)


def test_rows_in_other_float_dtypes(tmp_path, rng):
    ids = [7, 8]
    for dt in (np.float16, BF16, np.float64):
        rows = token_rows(rng, 2).astype(dt)
        d = save_adapter(tmp_path / str(np.dtype(dt)), tt_config(ids),
                         {f"{EMBED}.trainable_tokens_delta": rows})
        ov = overlay_from_peft(d, vocab=VOCAB)
        np.testing.assert_array_equal(bits(ov.embed.rows), bits(rows.astype(BF16)))


# -- trainable tokens inside LoRA ------------------------------------------------------------------

def test_lora_list_form(tmp_path, rng):
    ids = [11, 0, 62]
    rows = token_rows(rng, 3)
    tensors = attention_lora(rng) | {f"{EMBED}.token_adapter.trainable_tokens_delta": rows}
    d = save_adapter(tmp_path / "a", lora_config(trainable_token_indices=ids), tensors)
    ad = read_peft_adapter(d, vocab=VOCAB)
    assert ad.tied is None and ad.tied_matters
    assert ad.other_modules == tuple(sorted(f"model.layers.{i}.self_attn.{p}" for i in range(2)
                                            for p in ("q_proj", "v_proj")))
    untied = overlay_from_peft(d, vocab=VOCAB, tied=False)
    check_table(untied.embed, ids, rows)
    assert untied.lm_head is None
    tied = overlay_from_peft(d, vocab=VOCAB, tied=True)
    check_table(tied.embed, ids, rows)
    assert tied.lm_head is tied.embed
    # one file for a tied and an untied model: refused unless told
    with pytest.raises(PeftAdapterError, match="tie"):
        overlay_from_peft(d, vocab=VOCAB)
    # ... or told by the served tables: the same table is tied, two tables are not
    gpu = overlay_backend()
    se, sl = (DenseWeight.from_numpy(gpu, random_bf16(rng, (VOCAB, H))) for _ in range(2))
    assert overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se).lm_head is not None
    assert overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=sl).lm_head is None
    host = random_bf16(rng, (VOCAB, H))
    assert overlay_from_peft(d, vocab=VOCAB, served_embed=host, served_lm_head=host).lm_head is not None
    assert gpu.launches == []                          # token rows: nothing to compare


def test_lora_dict_form_untied(tmp_path, rng):
    e_ids, l_ids = [4, 50, 9], [50, 1]
    emb, lm = token_rows(rng, 3), token_rows(rng, 2)
    tensors = attention_lora(rng) | {f"{EMBED}.token_adapter.trainable_tokens_delta": emb,
                                     f"{LM}.token_adapter.trainable_tokens_delta": lm}
    d = save_adapter(tmp_path / "a", lora_config(trainable_token_indices={"embed_tokens": e_ids,
                                                                          "lm_head": l_ids}), tensors)
    for tied in (None, True, False):                   # both saved: served as saved
        ov = overlay_from_peft(d, vocab=VOCAB, tied=tied)
        check_table(ov.embed, e_ids, emb)
        check_table(ov.lm_head, l_ids, lm)


def test_lora_dict_form_tied_lm_head_skipped(tmp_path, rng):
    """Same ids for embed_tokens and lm_head on a tied model: PEFT ties and saves one tensor."""
    ids = [3, 33]
    emb = token_rows(rng, 2)
    d = save_adapter(tmp_path / "a", lora_config(trainable_token_indices={"embed_tokens": ids, "lm_head": ids}),
                     attention_lora(rng) | {f"{EMBED}.token_adapter.trainable_tokens_delta": emb})
    assert read_peft_adapter(d, vocab=VOCAB).tied is True
    ov = overlay_from_peft(d, vocab=VOCAB)
    check_table(ov.embed, ids, emb)
    assert ov.lm_head is ov.embed
    with pytest.raises(PeftAdapterError, match="tied=True"):
        overlay_from_peft(d, vocab=VOCAB, tied=False)


def test_lora_dict_form_other_names(tmp_path, rng):
    ids = [1, 2]
    rows = token_rows(rng, 2)
    key = f"{P}gpt_neox.embed_in_2.token_adapter.trainable_tokens_delta"
    d = save_adapter(tmp_path / "a", lora_config(trainable_token_indices={"embed_in_2": ids}), {key: rows})
    check_table(overlay_from_peft(d, vocab=VOCAB, tied=False).embed, ids, rows)  # a lone module
    # two modules of unknown names: the caller names them
    key2 = f"{P}out_proj_tokens.token_adapter.trainable_tokens_delta"
    d2 = save_adapter(tmp_path / "b", lora_config(trainable_token_indices={"embed_in_2": ids,
                                                                           "out_proj_tokens": [5]}),
                      {key: rows, key2: token_rows(rng, 1)})
    with pytest.raises(PeftAdapterError, match="lm_head_names"):
        overlay_from_peft(d2, vocab=VOCAB)
    ov = overlay_from_peft(d2, vocab=VOCAB, embed_names=["embed_in_2"], lm_head_names="out_proj_tokens")
    check_table(ov.embed, ids, rows)
    assert ov.lm_head.ids.tolist() == [5]


def test_encoder_decoder_copies_agree_or_refused(tmp_path, rng):
    ids = [6, 7]
    rows = token_rows(rng, 2)
    names = [f"{P}model.encoder.embed_tokens", f"{P}model.decoder.embed_tokens"]
    cfg = lora_config(trainable_token_indices={"embed_tokens": ids})
    d = save_adapter(tmp_path / "a", cfg, {f"{n}.token_adapter.trainable_tokens_delta": rows for n in names})
    check_table(overlay_from_peft(d, vocab=VOCAB, tied=False).embed, ids, rows)
    other = rows.copy()
    other[1, 0] += 1
    d2 = save_adapter(tmp_path / "b", cfg, {f"{names[0]}.token_adapter.trainable_tokens_delta": rows,
                                            f"{names[1]}.token_adapter.trainable_tokens_delta": other})
    with pytest.raises(PeftAdapterError, match="token id 7 given twice"):
        overlay_from_peft(d2, vocab=VOCAB, tied=False)


def test_duplicate_ids_in_one_list(tmp_path, rng):
    rows = token_rows(rng, 3)
    rows[2] = rows[0]
    d = save_adapter(tmp_path / "a", tt_config([9, 4, 9]), {f"{EMBED}.trainable_tokens_delta": rows})
    check_table(overlay_from_peft(d, vocab=VOCAB).embed, [9, 4], rows[:2])  # same row twice: one
    rows[2, 3] += 1
    d2 = save_adapter(tmp_path / "b", tt_config([9, 4, 9]), {f"{EMBED}.trainable_tokens_delta": rows})
    with pytest.raises(PeftAdapterError, match="token id 9 given twice"):
        overlay_from_peft(d2, vocab=VOCAB)


def test_adapter_name_left_in_keys(tmp_path, rng):
    ids = [12]
    rows = token_rows(rng, 1)
    d = save_adapter(tmp_path / "a", tt_config(ids), {f"{EMBED}.trainable_tokens_delta.default": rows})
    check_table(overlay_from_peft(d, vocab=VOCAB).embed, ids, rows)
    d2 = save_adapter(tmp_path / "b", tt_config(ids, ["embed_tokens", "lm_head"]),
                      {f"{EMBED}.trainable_tokens_delta.a1": rows, f"{LM}.trainable_tokens_delta.a2": rows})
    with pytest.raises(PeftAdapterError, match="several adapters"):
        overlay_from_peft(d2, vocab=VOCAB)


# -- modules_to_save full copies: build_overlay against the served tables --------------------------

def _mts_adapter(tmp_path, rng, served_e, served_l, key_form="peft"):
    ad_e = served_copy(rng, served_e, [0, 5, 6, 7, 63])
    ad_l = served_copy(rng, served_l, [2, 40])
    if key_form == "peft":
        keys = (f"{EMBED}.weight", f"{LM}.weight")
    else:
        keys = (f"{EMBED}.modules_to_save.default.weight", f"{LM}.modules_to_save.default.weight")
    d = save_adapter(tmp_path / key_form, lora_config(modules_to_save=["embed_tokens", "lm_head"]),
                     attention_lora(rng) | {keys[0]: ad_e, keys[1]: ad_l})
    return d, ad_e, ad_l


@pytest.mark.parametrize("key_form", ["peft", "modules_to_save_prefix"])
def test_modules_to_save_via_build_overlay(tmp_path, rng, key_form):
    gpu = overlay_backend()
    served_e, served_l = random_bf16(rng, (VOCAB, H)), random_bf16(rng, (VOCAB, H))
    d, ad_e, ad_l = _mts_adapter(tmp_path, rng, served_e, served_l, key_form)
    exp_e, exp_l = changed_rows(ad_e, served_e), changed_rows(ad_l, served_l)
    assert exp_e.tolist() == [0, 5, 6, 7, 63] and exp_l.tolist() == [2, 40]
    se, sl = DenseWeight.from_numpy(gpu, served_e), DenseWeight.from_numpy(gpu, served_l)
    live = set(gpu.mem)
    ov = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=sl)
    assert set(gpu.mem) == live                                  # temporaries freed
    assert [x["name"] for x in gpu.launches] == ["embed_rowdiff_bf16"] * 2
    check_table(ov.embed, exp_e, ad_e[exp_e])
    check_table(ov.lm_head, exp_l, ad_l[exp_l])
    # host served tables: uploaded for build_overlay when a gpu is given, else the host rule
    gpu.launches.clear()
    ov2 = overlay_from_peft(d, vocab=VOCAB, served_embed=served_e, served_lm_head=served_l, gpu=gpu)
    assert set(gpu.mem) == live and len(gpu.launches) == 2
    ov3 = overlay_from_peft(d, vocab=VOCAB, served_embed=served_e, served_lm_head=served_l)
    for o in (ov2, ov3):
        check_table(o.embed, exp_e, ad_e[exp_e])
        check_table(o.lm_head, exp_l, ad_l[exp_l])
    # a threshold drops the retrained rows that moved less
    big = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=sl, thresh=1e9)
    assert big.embed.n == 0 and big.lm_head.n == 0


def test_modules_to_save_embedding_only_tied(tmp_path, rng):
    """A copy of a tied embedding unties it in PEFT (the LM head keeps the original): LM head
    not overlaid, whatever tied says."""
    gpu = overlay_backend()
    served = random_bf16(rng, (VOCAB, H))
    ad = served_copy(rng, served, [1, 2])
    d = save_adapter(tmp_path / "a", lora_config(modules_to_save=["embed_tokens"]), {f"{EMBED}.weight": ad})
    se = DenseWeight.from_numpy(gpu, served)
    for tied in (None, True):
        ov = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se, tied=tied)
        check_table(ov.embed, [1, 2], ad[[1, 2]])
        assert ov.lm_head is None


def test_lm_head_copy_on_tied_served_table(tmp_path, rng):
    gpu = overlay_backend()
    served = random_bf16(rng, (VOCAB, H))
    ad = served_copy(rng, served, [8])
    d = save_adapter(tmp_path / "a", lora_config(modules_to_save=["lm_head"]), {f"{LM}.weight": ad})
    se = DenseWeight.from_numpy(gpu, served)
    with pytest.raises(PeftAdapterError, match="served_lm_head"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=se)
    ov = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se)
    assert ov.embed is None
    check_table(ov.lm_head, [8], ad[[8]])


def test_resized_vocab_full_table_with_tokens(tmp_path, rng):
    """save_embedding_layers="auto" on a resized vocabulary: the full embedding is saved next to
    the token rows; the rows that differ from the served (resized) table are served."""
    gpu = overlay_backend()
    served = random_bf16(rng, (VOCAB, H))
    base = served.astype(np.float32)
    base[[60, 61]] = token_rows(rng, 2)             # rows the served table does not have
    ids = [61, 62]
    rows = token_rows(rng, 2)
    d = save_adapter(tmp_path / "a", lora_config(trainable_token_indices=ids),
                     {f"{EMBED}.token_adapter.base_layer.weight": base,
                      f"{EMBED}.token_adapter.trainable_tokens_delta": rows})
    expect = base.copy()
    expect[ids] = rows
    expect = expect.astype(BF16)
    with pytest.raises(PeftAdapterError, match="served_embed"):
        overlay_from_peft(d, vocab=VOCAB, tied=False)
    ov = overlay_from_peft(d, vocab=VOCAB, served_embed=DenseWeight.from_numpy(gpu, served), tied=False)
    check_table(ov.embed, [60, 61, 62], expect[[60, 61, 62]].astype(np.float32))
    assert ov.lm_head is None
    # tied: the LM head is the same (resized) table with the same rows
    se = DenseWeight.from_numpy(gpu, served)
    for lm in (None, se):
        tied = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=lm, tied=True)
        check_table(tied.embed, [60, 61, 62], expect[[60, 61, 62]].astype(np.float32))
        assert tied.lm_head is tied.embed
    with pytest.raises(PeftAdapterError, match="resized"):
        overlay_from_peft(d, vocab=VOCAB - 1, tied=False)


# -- refusals -----------------------------------------------------------------------------------

def test_missing_files(tmp_path, rng):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        overlay_from_peft(tmp_path / "nope", vocab=VOCAB)
    rows = {f"{EMBED}.trainable_tokens_delta": token_rows(rng, 1)}
    save_adapter(tmp_path / "multi" / "second", tt_config([1]), rows)
    with pytest.raises(FileNotFoundError, match="subfolders: second"):
        overlay_from_peft(tmp_path / "multi", vocab=VOCAB)
    d = save_adapter(tmp_path / "noweights", tt_config([1]), None)
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        overlay_from_peft(d, vocab=VOCAB)
    (d / "adapter_model.bin").write_bytes(b"PK\x03\x04 torch zip")
    with pytest.raises(PeftAdapterError, match="safe_serialization"):
        overlay_from_peft(d, vocab=VOCAB)


@pytest.mark.parametrize("config, match", [
    ("{not json", "malformed"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"r": 8}), "peft_type"),
    (json.dumps(tt_config("1,2")), "token_indices must be a list"),
    (json.dumps(tt_config([])), "token_indices is empty"),
    (json.dumps(tt_config([1, True])), "token_indices must be a list"),
    (json.dumps(lora_config(trainable_token_indices={"embed_tokens": [1.5]})), "list of integers"),
    (json.dumps(lora_config(trainable_token_indices={})), "empty dict"),
    (json.dumps(lora_config(modules_to_save=[3])), "modules_to_save"),
], ids=["json", "array", "no_peft_type", "ids_str", "ids_empty", "ids_bool", "dict_float", "dict_empty",
        "mts_int"])
def test_malformed_config(tmp_path, rng, config, match):
    d = save_adapter(tmp_path / "a", None, {f"{EMBED}.token_adapter.trainable_tokens_delta": token_rows(rng, 1)})
    (d / "adapter_config.json").write_text(config)
    with pytest.raises(PeftAdapterError, match=match):
        overlay_from_peft(d, vocab=VOCAB)


def test_malformed_safetensors(tmp_path, rng):
    d = save_adapter(tmp_path / "a", tt_config([1]), {f"{EMBED}.trainable_tokens_delta": token_rows(rng, 1)})
    f = d / "adapter_model.safetensors"
    good = f.read_bytes()
    for blob, match in ((good[:-4], "does not hold shape"), (good[:5], "too short for a safetensors"),
                        (struct.pack("<Q", 1 << 40) + good[8:], "runs past the end"),
                        (struct.pack("<Q", 4) + b"{bad", "header is not valid JSON")):
        f.write_bytes(blob)
        with pytest.raises(PeftAdapterError, match=match):
            overlay_from_peft(d, vocab=VOCAB)


def test_bad_ids_widths_and_values(tmp_path, rng):
    def case(name, cfg, tensors, match, **kw):
        d = save_adapter(tmp_path / name, cfg, tensors)
        with pytest.raises(PeftAdapterError, match=match):
            overlay_from_peft(d, **{"vocab": VOCAB, **kw})

    key = f"{EMBED}.trainable_tokens_delta"
    case("vocab", tt_config([3, VOCAB]), {key: token_rows(rng, 2)}, f"token id {VOCAB} .* outside")
    case("negative", tt_config([-1, 3]), {key: token_rows(rng, 2)}, "token id -1")
    # a vocabulary past int32: an id there wrapped into the overlay's int32 ids (2**32 + 5 became 5)
    case("int32", tt_config([2**32 + 5]), {key: token_rows(rng, 1)}, r"token id 4294967301 .* outside .*2147483647",
         vocab=2**33)
    case("huge", tt_config([2**70]), {key: token_rows(rng, 1)}, "token id 1180591620717411303424")
    case("count", tt_config([1, 2, 3]), {key: token_rows(rng, 2)}, r"expected \[3, h\]")
    case("1d", tt_config([1]), {key: token_rows(rng, 1)[0]}, r"expected \[1, h\]")
    case("widths", tt_config([1], ["embed_tokens", "lm_head"]),
         {key: token_rows(rng, 1), f"{LM}.trainable_tokens_delta": token_rows(rng, 1, H + 1)}, "widths")
    case("hidden", tt_config([1]), {key: token_rows(rng, 1)}, "hidden_size", hidden_size=H * 2)
    case("base_vs_rows", lora_config(trainable_token_indices=[1]),
         {f"{EMBED}.token_adapter.base_layer.weight": token_rows(rng, VOCAB, H + 2),
          f"{EMBED}.token_adapter.trainable_tokens_delta": token_rows(rng, 1)}, "base layer table 18", tied=False)
    nan = token_rows(rng, 3)
    nan[1, 4] = np.nan
    case("nan", tt_config([1, 2, 3]), {key: nan}, r"non-finite .* token ids \[2\]")
    inf = token_rows(rng, 2)
    inf[0, 0] = np.inf
    case("inf", tt_config([1, 2]), {key: inf}, r"non-finite .* \[1\]")
    huge = token_rows(rng, 1)
    huge[0, 0] = np.float32(3.399e38)                  # finite in f32, inf in bf16
    case("overflow", tt_config([5]), {key: huge}, "too large for bf16")
    case("int_rows", tt_config([5]), {key: np.ones((1, H), np.int32)}, "not a float type")
    case("missing_tensor", lora_config(trainable_token_indices={"embed_tokens": [1], "lm_head": [2]}),
         {f"{EMBED}.token_adapter.trainable_tokens_delta": token_rows(rng, 1)}, "holds no trainable_tokens_delta")
    case("target_missing", tt_config([1], ["embed_tokens", "lm_head"]), {key: token_rows(rng, 1)},
         "target_modules names 'lm_head'")
    case("no_ids", lora_config(), {f"{EMBED}.token_adapter.trainable_tokens_delta": token_rows(rng, 1)},
         "no token ids")
    mts = served_copy(rng, random_bf16(rng, (VOCAB, H)), [1])
    mts[3, 2] = np.nan
    case("mts_nan", lora_config(modules_to_save=["embed_tokens"]), {f"{EMBED}.weight": mts},
         r"non-finite .* rows \[3\]")
    case("mts_and_tokens", lora_config(modules_to_save=["embed_tokens"], trainable_token_indices={"wte": [1]}),
         {f"{EMBED}.weight": served_copy(rng, random_bf16(rng, (VOCAB, H)), [1]),
          f"{P}transformer.wte.token_adapter.trainable_tokens_delta": token_rows(rng, 1)}, "conflicting")


def test_nothing_servable_refused(tmp_path, rng):
    d = save_adapter(tmp_path / "attn", lora_config(), attention_lora(rng))
    with pytest.raises(PeftAdapterError, match=r"nothing a token overlay can serve .* model\.layers\.0\.self_attn\.q_proj"):
        overlay_from_peft(d, vocab=VOCAB)
    r = 4
    emb_lora = {f"{EMBED}.lora_embedding_A": rng.standard_normal((r, VOCAB)).astype(np.float32),
                f"{EMBED}.lora_embedding_B": np.zeros((H, r), np.float32)}
    d2 = save_adapter(tmp_path / "emb", lora_config(target_modules=["embed_tokens", "q_proj"]),
                      attention_lora(rng) | emb_lora)
    with pytest.raises(PeftAdapterError, match="LoRA on the embedding .*lora_embedding_A"):
        overlay_from_peft(d2, vocab=VOCAB)
    # ... also next to rows an overlay could serve, and on the LM head
    d3 = save_adapter(tmp_path / "emb_tt", lora_config(target_modules=["lm_head"], trainable_token_indices=[1]),
                      {f"{EMBED}.token_adapter.trainable_tokens_delta": token_rows(rng, 1),
                       f"{LM}.lora_A.weight": token_rows(rng, r), f"{LM}.lora_B.weight": np.zeros((VOCAB, r), np.float32)})
    with pytest.raises(PeftAdapterError, match="LoRA on the LM head"):
        overlay_from_peft(d3, vocab=VOCAB, tied=False)
    d4 = save_adapter(tmp_path / "empty", lora_config(), {})
    with pytest.raises(PeftAdapterError, match="no tensors"):
        overlay_from_peft(d4, vocab=VOCAB)


def test_served_table_refusals_before_any_upload(tmp_path, rng):
    gpu = overlay_backend()
    served_e, served_l = random_bf16(rng, (VOCAB, H)), random_bf16(rng, (VOCAB, H))
    d, _, _ = _mts_adapter(tmp_path, rng, served_e, served_l)
    se = DenseWeight.from_numpy(gpu, served_e)
    narrow = DenseWeight.from_numpy(gpu, random_bf16(rng, (VOCAB, H - 1)))
    fp8 = DenseWeight.from_numpy(gpu, served_e.astype(ml_dtypes.float8_e4m3fn), np.ones(VOCAB, np.float32))
    live = set(gpu.mem)
    with pytest.raises(PeftAdapterError, match="served_embed"):
        overlay_from_peft(d, vocab=VOCAB)
    with pytest.raises(PeftAdapterError, match="served_lm_head"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=se)
    with pytest.raises(ValueError, match="shape"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=narrow)
    with pytest.raises(TypeError, match="bfloat16"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=fp8, served_lm_head=se)
    with pytest.raises(TypeError, match="bfloat16"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=served_e.astype(np.float32), served_lm_head=se)
    with pytest.raises(KernelNotFoundError, match="overlay"):   # before the host table is uploaded
        overlay_from_peft(d, vocab=VOCAB, served_embed=served_e, served_lm_head=served_l, gpu=gpu,
                          kernels=OverlayKernels.default())
    with pytest.raises(ValueError, match="thresh"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se, thresh=float("nan"))
    with pytest.raises(ValueError, match="thresh 1e\\+39 overflows f32"):  # refused before the first upload
        overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se, thresh=1e39)
    with pytest.raises(TypeError, match="tied"):
        overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=se, tied="yes")
    with pytest.raises(ValueError, match="vocab must be an int >= 1"):
        overlay_from_peft(d, vocab=0)
    with pytest.raises(TypeError, match="vocab must be an int"):
        overlay_from_peft(d, vocab=64.0)
    with pytest.raises(TypeError, match="hidden_size must be an int"):
        overlay_from_peft(d, vocab=VOCAB, hidden_size="16")
    assert gpu.launches == [] and set(gpu.mem) == live
    # a token adapter: a served table of the wrong width is refused too
    t = save_adapter(tmp_path / "tt", tt_config([1]), {f"{EMBED}.trainable_tokens_delta": token_rows(rng, 1)})
    with pytest.raises(ValueError, match="shape"):
        overlay_from_peft(t, vocab=VOCAB, served_embed=narrow)
    # and after the refusals it works
    ov = overlay_from_peft(d, vocab=VOCAB, served_embed=se, served_lm_head=DenseWeight.from_numpy(gpu, served_l))
    assert ov.embed.n == 5 and ov.lm_head.n == 2


# -- GPU: modules_to_save and trainable tokens through embed_rowdiff on the device ------------------

@pytest.mark.gpu
def test_overlay_from_peft_on_gpu(gpu, tmp_path, rng):
    vocab, h = 700, 64
    served_e, served_l = random_bf16(rng, (vocab, h)), random_bf16(rng, (vocab, h))
    changed = sorted(rng.choice(vocab, 37, replace=False).tolist())
    ad_e = served_copy(rng, served_e, changed)
    ad_l = served_copy(rng, served_l, [0, 699])
    d = save_adapter(tmp_path / "mts", lora_config(modules_to_save=["embed_tokens", "lm_head"]),
                     attention_lora(rng) | {f"{EMBED}.weight": ad_e, f"{LM}.weight": ad_l})
    se, sl = DenseWeight.from_numpy(gpu, served_e), DenseWeight.from_numpy(gpu, served_l)
    try:
        ov = overlay_from_peft(d, vocab=vocab, served_embed=se, served_lm_head=sl)
        exp_e, exp_l = changed_rows(ad_e, served_e), changed_rows(ad_l, served_l)
        assert exp_e.tolist() == changed
        check_table(ov.embed, exp_e, ad_e[exp_e])
        check_table(ov.lm_head, exp_l, ad_l[exp_l])
        ov_host = overlay_from_peft(d, vocab=vocab, served_embed=served_e, served_lm_head=served_l, gpu=gpu)
        check_table(ov_host.embed, exp_e, ad_e[exp_e])
        check_table(ov_host.lm_head, exp_l, ad_l[exp_l])
    finally:
        se.close()
        sl.close()
