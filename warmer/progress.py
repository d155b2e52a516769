"""Progress lines for long work: each step as it starts and as it ends, with its seconds and the log
file to follow where there is one. A build is minutes of engine runs: a silent terminal looks hung.

    with progress.step("build: warm-up engine run", log_file=path) as s:
        run = ...
        s.done(f"{run.files} files")       # added to the end line

Lines go to the "warmer" logger at INFO: the CLI shows them on stderr unless -q or --json; a library
caller configures logging as it likes. Leaf module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("warmer")


class Step:
    def __init__(self, what: str):
        self.what, self.detail = what, ""

    def done(self, detail: str) -> None:
        """What the end line says besides the seconds (a count, a verdict)."""
        self.detail = detail


@contextmanager
def step(what: str, log_file: object = None) -> Iterator[Step]:
    """One step: a line as it starts, one as it ends (or fails), each naming log_file when given."""
    where = f" (log {log_file})" if log_file else ""
    log.info("%s ...%s", what, where)
    s, t0 = Step(what), time.perf_counter()
    try:
        yield s
    except BaseException:
        log.info("%s stopped after %.1f s%s", what, time.perf_counter() - t0, where)
        raise
    log.info("%s done in %.1f s%s%s", what, time.perf_counter() - t0, f": {s.detail}" if s.detail else "", where)
