"""How long a node waits on a store: one deadline for a whole fetch, and the retry lines on the way.

A fetch sits in a pod's init container: a store that stalls, trickles or answers errors must end
as a miss (a slow start) within the deadline, never as a pod that does not start. Each request
still has its own connect and read timeouts; the deadline bounds their sum with the retries, and
what no timeout can bound (a body that trickles a few bytes a second) is cut by it.

    deadline = Deadline(120, "fetch")
    raw = deadline.call(lambda: store.get_index(r, k), "reading the index entry")   # abandons a hung call
    deadline.retrying(2, 8, 1.3, "read timeout after 20 s", "GET index/...")          # says so on stderr

Retry lines go to the "warmer" logger: the CLI shows them on stderr unless -q or --json; a
library caller configures logging as it likes. Leaf module: imports nothing from warmer but errors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from warmer.errors import StoreError, UsageError

log = logging.getLogger("warmer")
T = TypeVar("T")

DEFAULT_S = 120.0  # the whole fetch: index, download, restore (huggingface_hub reads in 10 s)
CONNECT_TIMEOUT_S = 5.0  # one TCP (and TLS) connect
READ_TIMEOUT_S = 20.0  # one read on a connection that has sent nothing
# A connection that brings fewer than LOW_SPEED_BYTES in a window is cut and asked again (curl's
# --speed-limit/--speed-time, git's http.lowSpeedLimit): a trickle of a few bytes a second never
# trips a read timeout. 64 KiB in 15 s is a link some 1,000 times slower than an object store's.
LOW_SPEED_BYTES = 64 << 10
LOW_SPEED_S = 15.0
# Each of these is at most a quarter of a short deadline, so that a retry still fits in it.
SHARE = 4
ENV = "WARMER_DEADLINE"


class DeadlineExceeded(StoreError):
    """The deadline passed (or the fetch was cancelled): the message names it and what was slow."""


class Deadline:
    """A point in time (monotonic) past which work is abandoned, and what was slow on the way.

    seconds None: no deadline (only the per-request timeouts bound a call). A child deadline ends
    no later than its parent, and cancelling the parent cancels it (fetch --all on SIGTERM)."""

    def __init__(self, seconds: float | None = DEFAULT_S, what: str = "fetch", parent: Deadline | None = None):
        if seconds is not None and not seconds > 0:
            raise UsageError(f"deadline {seconds!r}: a deadline is a positive number of seconds")
        self.seconds, self.what, self.parent = seconds, what, parent
        self.at = time.monotonic() + seconds if seconds is not None else None
        if parent is not None and parent.at is not None and (self.at is None or parent.at < self.at):
            self.at = parent.at
        self.cancelled = False
        self.trouble = ""  # the last thing that went wrong (a timeout, a retry): named when it expires
        self.gave_up = False  # a retry was not made for want of time: the failure is the deadline's

    def child(self, what: str, seconds: float | None = None) -> Deadline:
        return Deadline(seconds if seconds is not None else self.seconds, what, parent=self)

    def cancel(self) -> None:
        self.cancelled = True

    def left(self) -> float:
        """Seconds until the deadline (infinity without one); 0 once it has passed or was cancelled."""
        if self.cancelled or (self.parent is not None and self.parent.cancelled):
            return 0.0
        return float("inf") if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.left() <= 0.0

    def _share(self, cap: float) -> float:
        return cap if self.seconds is None else max(1.0, min(cap, self.seconds / SHARE))

    @property
    def connect_timeout(self) -> float:
        return self._share(CONNECT_TIMEOUT_S)

    @property
    def read_timeout(self) -> float:
        return self._share(READ_TIMEOUT_S)

    @property
    def low_speed_s(self) -> float:
        """The window over which a connection must bring LOW_SPEED_BYTES."""
        return self._share(LOW_SPEED_S)

    def note(self, trouble: str) -> None:
        self.trouble = trouble

    def error(self, doing: str) -> DeadlineExceeded:
        if self.cancelled or (self.parent is not None and self.parent.cancelled):
            return DeadlineExceeded(f"{self.what} stopped while {doing}")
        last = f"; last: {self.trouble}" if self.trouble else ""
        seconds = self.seconds if self.seconds is not None else getattr(self.parent, "seconds", None) or 0
        return DeadlineExceeded(
            f"the {self.what} deadline of {seconds:.0f} s (--deadline, {ENV}) passed while {doing}{last}"
        )

    def check(self, doing: str) -> None:
        if self.expired():
            raise self.error(doing)

    def allows(self, delay: float) -> bool:
        """Whether a retry after delay seconds still has time for a request; when it has not, the
        store's error names the deadline (gave_up)."""
        ok = delay + 1.0 < self.left()
        self.gave_up = self.gave_up or not ok
        return ok

    def retrying(self, attempt: int, attempts: int, delay: float, why: str, what: str) -> None:
        """One line on the logger for a retry about to happen (attempt of attempts, after delay)."""
        self.note(f"{why} ({what})")
        log.info("retrying %s %d/%d in %.1f s: %s", what, attempt, attempts, delay, why)

    def call(self, fn: Callable[[], T], doing: str) -> T:
        """fn() in a thread of its own, waited for until the deadline: past it DeadlineExceeded, and
        fn is abandoned (a daemon thread: its own timeouts end it). Only for calls with no effect to
        undo (reads); SIGTERM and Ctrl-C still reach this thread while it waits."""
        if self.at is None and not self.cancelled:
            return fn()
        done = threading.Event()
        out: list = []

        def run() -> None:
            try:
                out.append((True, fn()))
            except BaseException as e:  # handed to the waiting thread
                out.append((False, e))
            finally:
                done.set()

        threading.Thread(target=run, name="warmer-bounded-call", daemon=True).start()
        while not done.wait(min(1.0, self.left()) or 0.01):
            if self.expired():
                raise self.error(doing)
        ok, value = out[0]
        if ok:
            return value
        raise value


def unbounded() -> Deadline:
    return Deadline(None)


def map_on_daemon_threads(fn, items: list, threads: int, deadline: Deadline | None = None, doing: str = "") -> list:
    """[fn(item) for item in items], on up to threads daemon threads; the first error is raised.
    Not a ThreadPoolExecutor: the interpreter joins its workers at exit, so a listing a fetch's
    deadline or SIGTERM abandoned held the process for every request still waiting on a stalled
    store (a read timeout each); daemon threads end with it. Past deadline no item is begun (an
    abandoned map went on parsing entries beside the fetch that gave up on it), and the map raises
    DeadlineExceeded: it never returns a part of the list."""
    out: list = [None] * len(items)
    todo = iter(enumerate(items))
    lock = threading.Lock()
    failed: list[BaseException] = []

    def work() -> None:
        while not failed:
            with lock:
                nxt = next(todo, None)
            if nxt is None:
                return
            if deadline is not None and deadline.expired():
                failed.append(deadline.error(doing))
                return
            try:
                out[nxt[0]] = fn(nxt[1])
            except BaseException as e:  # handed to the caller's thread
                failed.append(e)

    workers = [threading.Thread(target=work, name="warmer-map", daemon=True) for _ in range(min(threads, len(items)))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if failed:
        raise failed[0]
    return out
