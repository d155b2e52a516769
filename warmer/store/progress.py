"""A one-line transfer bar on stderr, for people at a terminal (the caller decides when)."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Bytes done (of total when known) and the rate, redrawn in place at most 10 times a second.

    Callable with a byte count, as boto3's transfer Callback: it is called from the transfer's
    worker threads, and with a negative count when a part is retried.
    """

    def __init__(self, label: str, total: int | None = None, stream=None):
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= 0.1:
                self._last = now
                self._draw(now, "")

    def close(self) -> None:
        with self._lock:
            self._draw(time.monotonic(), "\n")

    def _draw(self, now: float, end: str) -> None:
        rate = self.done / max(now - self._t0, 1e-3) / 1e6
        of = f" / {self.total / 1e6:.1f} MB ({100 * self.done / self.total:.0f}%)" if self.total else " MB"
        eta = ""
        if self.total and rate > 0 and self.done < self.total and not end:
            eta = f", {(self.total - self.done) / 1e6 / rate:.0f} s left"
        self.stream.write(f"\rwarmer: {self.label}: {self.done / 1e6:.1f}{of}, {rate:.1f} MB/s{eta}\033[K{end}")
        self.stream.flush()
