"""How the converter (``layers.ngram_embed.convert``) reports its progress, chosen per run:

* stderr is a terminal and tqdm is installed (the ``progress`` extra): one tqdm bar per table;
* otherwise (a log file, a pipe, or no tqdm): lines through the ``layers.ngram_embed.convert``
  logger, one when a table is finished and, within a table, at most one per ``interval`` seconds
  (rows done, MB/s); nothing is written with ``\\r``;
* ``enabled=False``: nothing.

Notes between tables (a table skipped, a table written again) go through the logger in every
mode. The logger has no handler of its own: the command line configures logging in its ``main``;
a program that calls ``convert`` sees the lines once it configures logging (INFO).
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

LOG = logging.getLogger("layers.ngram_embed.convert")
DEFAULT_INTERVAL = 30.0  # seconds between two log lines within one table


def _tqdm_class() -> Any:
    """tqdm's bar class, or None where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class TableProgress:
    """The progress of one table: ``update(rows_done)`` after every chunk, ``done(note)`` once it is
    written; used as a context manager, which ends a bar however the table ends."""

    def __init__(self, mode: str, label: str, rows: int, row_bytes: int, interval: float) -> None:
        self.mode, self.label, self.rows, self.row_bytes, self.interval = mode, label, rows, row_bytes, interval
        self.t0 = self.last = time.perf_counter()
        self.bar: Any = None
        if mode == "bar":
            tqdm = _tqdm_class()
            self.bar = tqdm(
                total=rows * row_bytes,
                desc=label,
                unit="B",
                unit_scale=True,  # MB/s as the log lines count (1e6)
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )

    def _rate(self, rows_done: int, now: float) -> float:
        return rows_done * self.row_bytes / max(now - self.t0, 1e-9) / 1e6

    def update(self, rows_done: int) -> None:
        if self.bar is not None:
            self.bar.update(rows_done * self.row_bytes - self.bar.n)
        elif self.mode == "log":
            now = time.perf_counter()
            if now - self.last >= self.interval and rows_done < self.rows:
                self.last = now
                pct = 100.0 * rows_done / self.rows if self.rows else 100.0
                LOG.info(
                    "%s: rows %d/%d (%.1f%%), %.1f MB/s",
                    self.label,
                    rows_done,
                    self.rows,
                    pct,
                    self._rate(rows_done, now),
                )

    def done(self, note: str) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.close()
        elif self.mode == "log":
            LOG.info(
                "%s: %d rows, %.1f MB in %.1f s (%.1f MB/s), %s",
                self.label,
                self.rows,
                self.rows * self.row_bytes / 1e6,
                now - self.t0,
                self._rate(self.rows, now),
                note,
            )

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()

    def __enter__(self) -> TableProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Progress:
    """The run's choice of bar, log lines or nothing (see the module docstring); ``table(...)``
    starts one table's progress, ``note(...)`` logs a line between tables."""

    def __init__(self, enabled: bool = True, interval: float = DEFAULT_INTERVAL) -> None:
        if interval < 0:
            raise ValueError(f"interval must be >= 0 seconds, got {interval!r}")
        self.enabled, self.interval = enabled, float(interval)
        if not enabled:
            self.mode = "off"
        elif _isatty(sys.stderr) and _tqdm_class() is not None:
            self.mode = "bar"
        else:
            self.mode = "log"

    def table(self, label: str, rows: int, row_bytes: int) -> TableProgress:
        return TableProgress(self.mode, label, rows, row_bytes, self.interval)

    def note(self, message: str, *, warning: bool = False) -> None:
        if self.enabled or warning:
            LOG.log(logging.WARNING if warning else logging.INFO, "%s", message)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
