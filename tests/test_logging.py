"""Slow-path notices (CPU): the ``gpu_runtime`` and ``layers`` loggers say when NVRTC compiles a
kernel module, when the loader puts tables in host memory, and when a RowCache misses most of a
batch; and nothing is printed unless the application configures logging."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpu_runtime import compiler
from layers.ngram_embed import DeviceBudget, NgramWeights, RowCache
from layers.ngram_store.cache_group import CacheGroup
from tests.helpers.checkpoint import make_model, write_model
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.row_cache import mem_gpu, table_file

ROOT = Path(__file__).resolve().parent.parent


def records(caplog, logger: str, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(logger) and r.levelno == level]


# -- gpu_runtime: a kernel module compiled by NVRTC ---------------------------------------------
def test_an_nvrtc_compile_is_logged_and_a_cache_hit_is_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiler, "_nvrtc_compile", lambda source, name, target, options: (b"image", ""))
    src = tmp_path / "tiny.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[0] = 1; }\n')
    caplog.set_level(logging.INFO, logger="gpu_runtime")
    assert not compiler.compile_module(src, "sm_90a").cached
    (record,) = records(caplog, "gpu_runtime")
    assert record.name == "gpu_runtime.compiler"
    message = record.getMessage()
    assert "'tiny'" in message and "sm_90a" in message and "cache miss" in message
    assert message.split(" in ")[1].split(" s ")[0].replace(".", "").isdigit()  # the seconds
    caplog.clear()
    assert compiler.compile_module(src, "sm_90a").cached
    assert records(caplog, "gpu_runtime") == []  # a cache hit costs nothing worth a notice


# -- layers: tables placed in host memory by the loader -------------------------------------------
@pytest.fixture
def model(tmp_path, rng):
    return write_model(tmp_path / "m", make_model(rng, kinds="b"))


def _host_notices(caplog, model, placement) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="layers"):
        NgramWeights.from_pretrained(model.path, LoggingBackend(), placement=placement).close()
    return [r.getMessage() for r in records(caplog, "layers.ngram_embed.pretrained")]


def test_host_tables_are_logged_with_the_reason(model, caplog):
    (message,) = _host_notices(caplog, model, "host")
    assert "4 of 4 tables in host memory" in message and "tables 0, 1, 2, 3" in message
    assert "placement='host'" in message
    (message,) = _host_notices(caplog, model, ["device", "host", "device", "host"])
    assert "2 of 4 tables in host memory" in message and "tables 1, 3" in message and "placement names" in message
    dims = model.dims
    fixed = dims.vocab_size * dims.hidden_size * 2 + dims.num_tables() * dims.hidden_size * dims.table_dim() * 2
    budget = fixed + model.tables[0][0].nbytes  # room for table 0 only
    (message,) = _host_notices(caplog, model, DeviceBudget(budget))
    assert "3 of 4 tables in host memory" in message and "tables 1, 2, 3" in message
    assert f"do not fit DeviceBudget({budget})" in message
    assert _host_notices(caplog, model, "device") == []


# -- layers: a RowCache missing most of a batch ---------------------------------------------------
@pytest.fixture
def cache(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(RowCache, "_miss_warned_at", float("-inf"))  # no earlier test's notice holds it back
    path, _, _ = table_file(tmp_path, rng, 4096, 8, False)
    with RowCache(mem_gpu(), path, 1024) as c:
        yield c


def _resolve(cache: RowCache, ids) -> None:
    ids = np.asarray(ids, np.uint32)
    cache.resolve(ids, np.empty(ids.size, np.uint32))
    cache.end_batch()


def test_a_batch_of_mostly_misses_is_one_warning_per_interval(cache, caplog):
    assert (RowCache.miss_warn_fraction, RowCache.miss_warn_rows, RowCache.miss_warn_seconds) == (0.5, 64, 60.0)
    caplog.set_level(logging.WARNING, logger="layers")
    _resolve(cache, range(200))  # 200 misses of 200 ids
    (record,) = records(caplog, "layers", logging.WARNING)
    assert record.name == "layers.ngram_store.row_cache"
    message = record.getMessage()
    assert "t.ngt" in message and "200 of a batch's 200 ids missed" in message
    assert "the arena holds 1024 of 4096 rows" in message and "no such notice for 60 s" in message
    _resolve(cache, range(200, 400))  # as bad, within the interval: held back
    assert len(records(caplog, "layers", logging.WARNING)) == 1
    cache.miss_warn_seconds = 0.0
    _resolve(cache, range(400, 600))
    assert len(records(caplog, "layers", logging.WARNING)) == 2


def test_misses_under_the_thresholds_are_not_logged(cache, caplog):
    cache.miss_warn_seconds = 0.0
    caplog.set_level(logging.WARNING, logger="layers")
    _resolve(cache, range(63))  # every id a miss, but fewer than miss_warn_rows
    resident = list(range(63)) + list(range(1000, 1063))
    _resolve(cache, resident)  # 63 misses again: too few, and half the batch
    _resolve(cache, resident + list(range(2000, 2100)))  # 100 misses of 226 ids: 44%, under half
    _resolve(cache, resident)  # all hits
    assert records(caplog, "layers", logging.WARNING) == []
    cache.miss_warn_fraction = 0.4
    _resolve(cache, resident + list(range(3000, 3100)))  # 44% again, now over the fraction
    assert len(records(caplog, "layers", logging.WARNING)) == 1


def test_a_cache_group_warns_through_its_members(tmp_path, rng, caplog, monkeypatch):
    monkeypatch.setattr(RowCache, "_miss_warned_at", float("-inf"))
    gpu = mem_gpu()
    caches = [RowCache(gpu, table_file(tmp_path, rng, 2048, 8, False, f"t{k}.ngt")[0], 512) for k in range(2)]
    group = CacheGroup(caches)
    caplog.set_level(logging.WARNING, logger="layers")
    ids = rng.integers(0, 2048, (2, 128)).astype(np.uint32)
    group.resolve(ids, np.empty((128, 2), np.uint32))
    group.end_batch()
    (record,) = records(caplog, "layers", logging.WARNING)  # one per interval across every cache
    assert "t0.ngt" in record.getMessage()
    for c in caches:
        c.close()


# -- silent by default ------------------------------------------------------------------------------
SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, tempfile
    from pathlib import Path
    import numpy as np

    if sys.argv[1] == "on":
        logging.basicConfig(level=logging.INFO)
    tmp = Path(tempfile.mkdtemp())
    os.environ["GPU_RUNTIME_CACHE_DIR"] = str(tmp / "cache")
    from gpu_runtime import compiler
    (tmp / "k.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = 1; }\\n')
    compiler.compile_module(tmp / "k.cu", "compute_90")
    from layers.ngram_embed import NgramWeights, RowCache
    from tests.helpers.checkpoint import make_model, write_model
    from tests.helpers.logging_backend import LoggingBackend
    from tests.helpers.row_cache import mem_gpu, table_file
    rng = np.random.default_rng(0)
    model = write_model(tmp / "m", make_model(rng, kinds="b"))
    NgramWeights.from_pretrained(model.path, LoggingBackend(), placement="host").close()
    path, _, _ = table_file(tmp, rng, 1000, 8, False)
    with RowCache(mem_gpu(), path, 512) as cache:
        cache.resolve(np.arange(200), np.empty(200, np.uint32))
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_nothing_is_printed_unless_logging_is_configured(capsys):
    """Every notice happens, in a fresh process with logging untouched: nothing on stdout or
    stderr (the library's NullHandlers keep Python's last-resort handler from printing the
    WARNING). With ``logging.basicConfig(level=logging.INFO)`` all three are printed."""
    quiet = _run("off")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == ""
    loud = _run("on")
    assert loud.returncode == 0, loud.stderr
    assert "INFO:gpu_runtime.compiler:NVRTC compiled kernel module 'k' for compute_90" in loud.stderr
    assert "INFO:layers.ngram_embed.pretrained:NgramWeights.from_pretrained: 4 of 4 tables in host memory" in loud.stderr
    assert "WARNING:layers.ngram_store.row_cache:RowCache" in loud.stderr
    for name in ("gpu_runtime", "layers"):  # the library adds a NullHandler, and nothing else
        handlers = logging.getLogger(name).handlers
        assert handlers and all(type(h) is logging.NullHandler for h in handlers)
        assert logging.getLogger(name).level == logging.NOTSET
    assert capsys.readouterr() == ("", "")
