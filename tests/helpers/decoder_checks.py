"""The decoder's GPU checks, written once for every decoder ``World`` they run on: the plain
decoder (``tests.helpers.decoder.World``, in test_ngram_decoder.py) and the decoder over a one-rank
shard (``tests.helpers.tensor_parallel.RankWorld``, in test_tensor_parallel_runners.py). Each check takes
the world, drives its decoder beside the fused path and asserts every output row bit for bit, into
poisoned, guarded outputs; where the world has a recording collective (``world.collective``, a
``RankWorld``'s) it also checks that a launch all-reduces once. ``CHECKS``: each as a pytest param
(``check(world)``), for a test module to parametrize its one test over."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from layers.ngram_embed import DecodeError
from tests.helpers import bits
from tests.helpers.decoder import u32

BAD_DEVICE_VALUES = ["token", "slot", "seqlens", "rollback"]


def _forget_all_reduces(world) -> None:
    if world.collective is not None:
        world.collective.calls.clear()


def _assert_one_all_reduce(world, rows: int) -> None:
    """Since the collective's calls were last cleared, the decoder all-reduced once, in place in
    its projection buffer on the world's stream: ``rows`` word rows and the gathered table rows
    (``rows * (H + T td)`` bf16 values). A world without a collective has none to check."""
    if world.collective is None:
        return
    dims = world.dims
    count = rows * (dims.hidden_size + dims.num_tables() * dims.table_dim())
    assert world.collective.calls == [("allreduce", int(world.dec.projection.buf), count, world.stream)]


def ragged_and_chunked_prefill(world) -> None:
    lens = [7, 1, 0, 2, 30, 12]  # a slot with no tokens, sequences shorter than N - 1
    got, want = world.prefill(list(range(6)), lens)
    assert np.array_equal(bits(got), bits(want))
    assert np.isfinite(got.astype(np.float32)).all()
    _assert_one_all_reduce(world, sum(lens))
    # Chunked prefill: later chunks continue each slot's history.
    for _ in range(3):
        chunk = [int(world.rng.integers(0, 9)) for _ in range(3)]
        got, want = world.prefill([4, 0, 2], chunk)
        assert np.array_equal(bits(got), bits(want))
    for s in range(6):
        n = world.dims.max_ngram - 1
        assert world.dec.history(s).tolist() == world.ctx[s][-n:]
    assert world.dec.check_errors() == DecodeError.NONE


def graph_replayed_steps_with_resets_and_reuse(world) -> None:
    gpu, dec, rng = world.gpu, world.dec, world.rng
    slots = [0, 1, 2, 3]
    world.prefill(slots, [5, 1, 9, 2])
    d_tok, d_slots = u32(gpu, np.zeros(4)), u32(gpu, slots)
    out = world.out
    gpu.synchronize(0)
    dec.step(d_tok, d_slots, 4, out.ptr, world.stream)  # eager once: loads kernels, sets attributes
    gpu.synchronize(world.stream)
    for s in slots:
        world.ctx[s].append(0)
    _forget_all_reduces(world)
    gpu.begin_capture(world.stream)
    dec.step(d_tok, d_slots, 4, out.ptr, world.stream)
    graph = gpu.end_capture(world.stream)
    try:
        _assert_one_all_reduce(world, 4)  # captured into the graph, replayed with it
        for step in range(100):
            if step in (30, 71):  # a request ends; its slot is reused by a new one
                slot = slots[step % 4]
                world.reset(slot)
                new = world.tokens(int(rng.integers(1, 6)))
                with u32(gpu, new) as t, u32(gpu, [0, new.size]) as cu, u32(gpu, [slot]) as sl:
                    gpu.synchronize(0)
                    dec.prefill(t, cu, sl, 1, new.size, out.ptr, world.stream)
                    gpu.synchronize(world.stream)
                world.ctx[slot].extend(int(x) for x in new)
            toks = world.tokens(4)
            gpu.synchronize(world.stream)
            gpu.copy_h2d_async(toks, d_tok.ptr, world.stream)
            out.poison()
            gpu.synchronize(0)
            gpu.launch_graph(graph, world.stream)
            got = world.read(4)
            for s, t in zip(slots, toks):
                world.ctx[s].append(int(t))
            want = world.expect(slots, [1] * 4, 4)
            assert np.array_equal(bits(got), bits(want)), step
        assert dec.check_errors() == DecodeError.NONE
    finally:
        gpu.destroy_graph(graph)
        d_tok.free()
        d_slots.free()


def k_token_steps_with_rollbacks(world) -> None:
    """Twelve steps of k tokens a sequence (k up to the decoder's max_draft), each followed by a
    rollback of up to k rejected drafts."""
    gpu, dec, rng = world.gpu, world.dec, world.rng
    slots = [5, 2, 0]
    world.prefill(slots, [4, 1, 6])
    for it in range(12):
        k = int(rng.integers(1, dec.max_draft + 1))
        toks = world.tokens(3 * k)
        with u32(gpu, toks) as t, u32(gpu, slots) as sl:
            world.out.poison()
            gpu.synchronize(0)
            dec.step(t, sl, 3, world.out.ptr, world.stream, k=k)
            got = world.read(3 * k)
        for i, s in enumerate(slots):
            world.ctx[s].extend(int(x) for x in toks[i * k:(i + 1) * k])
        want = world.expect(slots, [k] * 3, 3 * k)
        assert np.array_equal(bits(got), bits(want)), it
        counts = rng.integers(0, k + 1, 3)  # drafts rejected
        with u32(gpu, slots) as sl, u32(gpu, counts) as c:
            gpu.synchronize(0)
            dec.rollback(sl, c, 3, world.stream)
            gpu.synchronize(world.stream)
        for s, n in zip(slots, counts):
            if n:
                del world.ctx[s][-int(n):]
    assert dec.check_errors() == DecodeError.NONE


def a_short_write_after_a_rollback_bounds_the_next_rollback(world, short: str) -> None:
    """A step of 3 drafts, a rollback of all 3, then a write of 1 token (a step, or with
    ``short="seed"`` a prefix-cache seed): two rejected drafts still sit in the ring (N - 1 +
    max_draft = 5 tokens) over the oldest positions it held, so a rollback of 3 more would look
    back on them. It is refused (``ROLLBACK``) and changes nothing; a rollback of 1 is taken, and
    the next step reads the right window."""
    gpu, dec = world.gpu, world.dec
    assert (dec.dims.max_ngram, dec.max_draft) == (3, 3)
    slot = [1]
    world.prefill(slot, [6])
    drafts = world.tokens(3)
    with u32(gpu, drafts) as t, u32(gpu, slot) as sl, u32(gpu, [3]) as c:
        gpu.synchronize(0)
        dec.step(t, sl, 1, world.out.ptr, world.stream, k=3)
        dec.rollback(sl, c, 1, world.stream)
        gpu.synchronize(world.stream)
    if short == "seed":
        token = world.tokens(1)
        with u32(gpu, token) as t, u32(gpu, [0, 1]) as cu, u32(gpu, slot) as sl:
            gpu.synchronize(0)
            dec.seed(t, cu, sl, 1, 1, world.stream)
            gpu.synchronize(world.stream)
        world.ctx[1].append(int(token[0]))
    else:
        world.step(world.tokens(1), slot)
    assert dec.check_errors() == DecodeError.NONE
    history = dec.history(1).tolist()
    assert history == world.ctx[1][-2:]
    for count, flag in [(3, DecodeError.ROLLBACK), (2, DecodeError.ROLLBACK), (1, DecodeError.NONE)]:
        with u32(gpu, slot) as sl, u32(gpu, [count]) as c:
            gpu.synchronize(0)
            dec.rollback(sl, c, 1, world.stream)
            gpu.synchronize(world.stream)
        assert dec.check_errors() == flag, count
    del world.ctx[1][-1:]
    assert dec.history(1).tolist() == world.ctx[1][-2:]
    got = world.step(world.tokens(1), slot)
    assert np.array_equal(bits(got), bits(world.expect(slot, [1], 1)))


def bad_device_values_are_flagged_and_contained(world, bad: str) -> None:
    """``bad`` (one of ``BAD_DEVICE_VALUES``): a bad token, slot or cu_seqlens in a prefill of three
    sequences, or a rollback deeper than max_draft 3 in one of three slots. Flagged in the error
    word (reading it clears it); the bad input's rows are zeros, the good rows the fused path's;
    the bad sequence's history is left alone or sanitised, every other one carries on."""
    gpu, dec, v = world.gpu, world.dec, world.dims.vocab_size
    world.prefill([0, 1, 2], [6, 3, 4])
    before = {s: dec.history(s).tolist() for s in range(6)}
    toks = world.tokens(8)
    cu = np.array([0, 3, 5, 8], np.uint32)
    slots = np.array([0, 1, 2], np.uint32)
    if bad == "token":
        toks[4] = v + 3  # second sequence, second row
    elif bad == "slot":
        slots[1] = 6
    elif bad == "seqlens":
        cu[2:] = [7, 5]  # the last sequence runs backwards and the total is not 8
    world.out.poison()
    gpu.synchronize(0)
    if bad == "rollback":
        with u32(gpu, [0, 1, 2]) as sl, u32(gpu, [0, 3 + 4, 1]) as c:  # 7 > max_draft 3
            gpu.synchronize(0)
            dec.rollback(sl, c, 3, world.stream)
            gpu.synchronize(world.stream)
        world.ctx[2].pop()
        assert dec.check_errors() == DecodeError.ROLLBACK
        assert dec.history(1).tolist() == before[1] and dec.history(2).tolist() == world.ctx[2][-2:]
        assert dec.check_errors() == DecodeError.NONE
        return
    with u32(gpu, toks) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
        gpu.synchronize(0)
        dec.prefill(t, c, sl, 3, 8, world.out.ptr, world.stream)
        got = world.read(8)
    want_flag = {"token": DecodeError.TOKEN, "slot": DecodeError.SLOT, "seqlens": DecodeError.SEQLENS}[bad]
    assert dec.check_errors() == want_flag
    assert dec.check_errors() == DecodeError.NONE  # cleared
    bad_rows = {"token": [4], "slot": [3, 4], "seqlens": [7]}[bad]
    assert not bits(got[bad_rows]).any(), "rows of bad input are zeros"
    good = [r for r in range(8) if r not in bad_rows]
    assert np.isfinite(got[good].astype(np.float32)).all()
    # The good sequence(s) continued normally; the bad one's slot was left alone or sanitised.
    world.ctx[0].extend(int(x) for x in toks[:3])
    want0 = world.expect([0], [3], 3)
    assert np.array_equal(bits(got[:3]), bits(want0))
    if bad == "slot":
        assert dec.history(1).tolist() == before[1]
    if bad == "seqlens":
        assert dec.history(2).tolist() == before[2]
    if bad == "token":
        assert dec.history(1).tolist() == [int(toks[3]), 0xFFFFFFFF]
    for s in range(3, 6):
        assert dec.history(s).tolist() == before[s]


CHECKS = [
    pytest.param(ragged_and_chunked_prefill, id="ragged_and_chunked_prefill_equal_the_fused_path"),
    pytest.param(graph_replayed_steps_with_resets_and_reuse, id="graph_replayed_decode_steps_with_resets_and_reuse"),
    pytest.param(k_token_steps_with_rollbacks, id="k_token_steps_with_rollbacks"),
    *[pytest.param(partial(a_short_write_after_a_rollback_bounds_the_next_rollback, short=short),
                   id=f"a_short_{short}_after_a_rollback_bounds_the_next_rollback") for short in ("step", "seed")],
    *[pytest.param(partial(bad_device_values_are_flagged_and_contained, bad=bad),
                   id=f"bad_device_values_are_flagged_and_contained-{bad}") for bad in BAD_DEVICE_VALUES],
]
