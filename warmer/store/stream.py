"""A blob as one ordered, checked stream, read in parallel ranges: what every store's stream_blob returns.

    store ──ranged reads, T threads──► part buffers (a window of W) ──read(), in order──► zstd ─► tar
                                            │
                                            └─► sha256 of the blob, in order, by the thread that
                                                completed the next part (not the reader's thread)

The reader (restore's extraction) reads each part as its bytes arrive, while later parts are
still arriving: when the last byte lands, almost nothing is left to unpack. At most W parts of
part_size bytes are held at any time, whatever the blob's size. At the end
of the blob, read() compares the digest with the blob's name and raises BlobCorrupt when they
differ, so that no caller can take unchecked bytes for the blob.

What can be checked where. The only digest a blob has is its name, over all of its bytes, so a
part cannot be checked alone:
  - a part that arrives short (a reset, a timeout, a body cut off, fewer bytes than asked, or a
    connection slower than LOW_SPEED_BYTES in the deadline's low_speed_s: a trickle) is detected by its length
    and asked for again from where it broke off, up to PART_ATTEMPTS times in a row, each retry
    said on the "warmer" logger (bytes once in a buffer never change: the reader may have taken
    them, and the digest must be over the bytes it took);
  - a part with the right length and wrong bytes is detected only at the end (the blob's
    digest), or earlier by what the bytes feed (zstd's checksums, a member's sha256). Either way
    the reader asks drain() whether the whole blob hashes to its name: if it does, the store
    really holds these bytes (the artifact itself is bad: refuse it); if not, they were damaged
    on the way, and the caller reads the blob again (restore does, into a fresh staging dir).

A backend gives one function, open_range(start, end) -> Answer, for bytes [start, end) of the
blob. An Answer whose `whole` is true carries the whole blob from byte 0 (a server that ignores
Range): the stream then reads that one answer in order, in one thread, through the same window.
An Answer's readinto returns what one read of the connection brings (never waits to fill the
view), so a stop or a trickle is seen between reads.

Time is bounded (warmer.deadline): the reader never waits past the stream's deadline, and
close() stops the threads without waiting on a connection that hangs (they are daemons, each
ended by its read timeout or its next bytes), so SIGTERM is honoured within a second or two.

Leaf module: imports nothing from warmer but the error types and the deadline.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

from warmer.deadline import LOW_SPEED_BYTES, Deadline, unbounded
from warmer.errors import StoreError, UsageError

MiB = 1 << 20
PART_ATTEMPTS = 5  # one part cut short this many times in a row: the download fails
DOWNLOAD_ATTEMPTS = 3  # whole reads of a blob over a network, when its bytes do not hash to its name
# The parts held at once (arriving, or downloaded and not yet read and hashed), in bytes: the
# memory a fetch holds for its download, whatever the blob's size. 32 MiB is four 8 MiB parts:
# three ranged GETs in flight and one part ahead of the reader. Object stores serve about
# 100 MB/s per connection: a node with a faster link raises it (WINDOW_ENV, in MiB), e.g. to
# 128 for 1 GB/s.
WINDOW_BYTES = 32 * MiB
WINDOW_ENV = "WARMER_FETCH_WINDOW_MIB"
# What one readinto asks of an answer: urllib3 (under requests and botocore) reads into a
# temporary of the size asked, then copies; a part's worth at a time would allocate 8 MiB per call.
READ_CHUNK = 1 * MiB
CLOSE_WAIT_S = 1.0  # close() waits this long in all for the threads, then leaves them (daemons)


class BlobCorrupt(StoreError):
    """A blob's bytes do not hash to its name, even after downloading it again."""

    got = ""


class BlobMissing(StoreError):
    """An index entry names a blob the store does not hold."""


class Cut(Exception):
    """An answer's body ended early or broke off (a reset, a timeout): the reason, in a few words."""


class Answer(Protocol):
    # Read-only here, so that an answer may narrow them (a file's total is always an int).
    @property
    def total(self) -> int | None:
        """The blob's size as the answer tells it (Content-Range's, or the file's)."""

    @property
    def whole(self) -> bool:
        """The body is the whole blob from byte 0, whatever range was asked."""

    def readinto(self, view: memoryview) -> int:
        """Bytes of the body into view, as one read of the connection brings them (at least one,
        never waiting to fill view); 0 at its end. Raises Cut when the body breaks off."""

    def close(self) -> None: ...


OpenRange = Callable[[int, int], Answer]


def window_from_env() -> int:
    """The node's download window: the operator's setting, so a typo is a UsageError (open_store asks
    first, before anything is read: raised inside a restore it was a miss on every fetch)."""
    raw = os.environ.get(WINDOW_ENV, "").strip()
    if not raw:  # unset, or set blank (an empty ConfigMap key): the default, as for every other variable
        return WINDOW_BYTES
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{WINDOW_ENV}={raw!r}: give a whole number of MiB, at least 1 (e.g. {WINDOW_ENV}=64)")
    return int(raw) * MiB


class BlobStream:
    """The blob's bytes in order (read, readinto), hashed as they arrive; BlobCorrupt at the end
    when they do not hash to sha256. Close it (or use it as a context manager) to stop the
    threads; closing before the end abandons the download."""

    hashes_itself = True  # archive.extract takes sha256 and bytes from here instead of hashing again

    def __init__(
        self,
        sha256: str,
        open_range: OpenRange,
        *,
        size: int | None = None,
        where: str = "the store",
        part_size: int = 8 * MiB,
        threads: int = 8,
        window_bytes: int | None = None,
        probe_first: bool = False,
        attempts: int = DOWNLOAD_ATTEMPTS,
        on_close: Callable[[], None] | None = None,
        backoff_s: float = 0.1,
        deadline: Deadline | None = None,
    ):
        if part_size < 1 or threads < 1:
            raise ValueError("part_size and threads must be positive")
        # At least two parts; one more part than reads in flight, so that a part waiting for the
        # reader does not stop every thread.
        window = max(2, (window_bytes or window_from_env()) // part_size)
        threads = max(1, min(threads, window - 1))
        self.name, self.where = sha256, where
        self.deadline = deadline or unbounded()
        self.attempts = attempts  # how many times a caller may read the blob again (restore's loop)
        self.sha256 = hashlib.sha256()
        self.bytes = 0  # delivered to the reader
        self._open_range, self._on_close = open_range, on_close
        self._part, self._window, self._backoff_s = part_size, window, backoff_s
        self._expected_size = size
        self._cond = threading.Condition()
        self._size: int | None = None if probe_first or size is None else size
        self._sequential = False
        self._bufs: dict[int, bytearray] = {}  # parts downloaded and not yet both read and hashed
        self._ready: set[int] = set()  # parts whose bytes are all in their buffer
        self._filled: dict[int, int] = {}  # bytes in the buffer so far, of parts being fetched
        self._free: list[bytearray] = []
        self._next_start = 0  # the next part a thread takes
        self._next_hash = 0  # the next part to hash (in order)
        self._hashing = False  # a thread is hashing now
        self._read_part = 0  # the part the reader is in
        self._leaving: int | None = None  # the reader took the last bytes of this part
        self._pos = 0  # the reader's offset in the blob
        self._error: BaseException | None = None
        self._stopped = False
        self.checked = False
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name="warmer-blob-reader", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    # -- what the reader sees ----------------------------------------------------------------------

    @property
    def size(self) -> int | None:
        with self._cond:
            self._wait_for_size()
            return self._size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            chunks = []
            while chunk := self.read(8 * MiB):
                chunks.append(chunk)
            return b"".join(chunks)
        view = self._next_view(n)
        return bytes(view) if view is not None else b""

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        view = self._next_view(len(out))
        if view is None:
            return 0
        out[: len(view)] = view
        return len(view)

    def drain(self) -> bool:
        """Read what is left without handing it out; True when the whole blob hashes to its name
        (the store holds exactly these bytes), False when it does not (damaged on the way)."""
        try:
            while self._next_view(self._part) is not None:
                pass
        except BlobCorrupt:
            if not self.checked:  # not the digest (e.g. a size that differs from the entry's)
                raise
            return False
        return True

    def refused(self, attempts: int) -> BlobCorrupt:
        """The error for a blob that never hashed to its name, after attempts reads of it."""
        got = self.sha256.hexdigest() if self.checked else "something else"
        if attempts == 1:
            e = BlobCorrupt(f"blob {self.name} in {self.where} hashes to {got}: corrupt in the store; not used")
        else:
            e = BlobCorrupt(
                f"blob {self.name} from {self.where} hashed to {got} on each of {attempts} "
                "downloads: corrupt in the store or altered on the way; not used"
            )
        e.got = got
        return e

    def close(self) -> None:
        """Stop the threads. A thread blocked on a connection that hangs is left behind (a daemon,
        ended by its read timeout or its next bytes): a stop never waits on the network."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        until = time.monotonic() + CLOSE_WAIT_S
        for t in self._threads:
            t.join(max(0.0, until - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        self._bufs.clear()
        self._free.clear()
        if self._on_close is not None and not self._threads:  # a thread left behind may still read
            self._on_close()
            self._on_close = None

    def __enter__(self) -> BlobStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wait_for_size(self) -> None:
        while self._size is None and self._error is None:
            self._wait("waiting for the first bytes")
        if self._error is not None:
            raise self._error

    def _wait(self, doing: str) -> None:
        """The reader's wait for the threads (under the lock), never past the deadline: a second
        at a time, so that the deadline (and a cancel) is seen while bytes trickle in."""
        if self.deadline.expired():
            raise self.deadline.error(f"{doing} of blob {self.name[:12]} from {self.where} ({self.bytes} bytes read)")
        self._cond.wait(min(1.0, self.deadline.left()))

    def _next_view(self, n: int) -> memoryview | None:
        """Up to n bytes at the reader's offset: a view of a part buffer, valid until the next
        call (its part is released only then); None at the end, once the digest has matched."""
        with self._cond:
            if self._leaving is not None:  # the view handed out last is no longer in use
                self._read_part, self._leaving = self._leaving + 1, None
                self._release(self._read_part - 1)
                self._cond.notify_all()
            self._wait_for_size()
            if self._pos >= self._known_size:
                self._finish()
                return None
            k = self._pos // self._part
            off = self._pos - k * self._part
            if self.deadline.expired():  # also when every byte is here and extraction is what takes long
                raise self.deadline.error(
                    f"downloading blob {self.name[:12]} from {self.where} ({self.bytes} of {self._size} bytes read)"
                )
            while self._arrived(k) <= off and self._error is None:
                self._wait("downloading")
            if self._error is not None:
                raise self._error
            buf = self._bufs[k]
            take = min(n, self._arrived(k) - off)
        self._pos += take
        self.bytes += take
        if off + take == self._part_len(k):
            self._leaving = k
        return memoryview(buf)[off : off + take]

    def _finish(self) -> None:
        """At the end (under the lock): wait until every part is hashed, then compare."""
        while self._next_hash < self._parts() and self._error is None:
            self._wait("hashing the last parts")
        if self._error is not None:
            raise self._error
        self.checked = True
        got = self.sha256.hexdigest()
        if got != self.name:
            e = BlobCorrupt(
                f"blob {self.name} from {self.where} hashed to {got}: corrupt in the store or altered on the way"
            )
            e.got = got
            raise e

    # -- parts -----------------------------------------------------------------------------------

    @property
    def _known_size(self) -> int:
        # Parts exist only once the first answer told the size (_decide; the reader: _wait_for_size).
        assert self._size is not None
        return self._size

    def _parts(self) -> int:
        return -(-self._known_size // self._part)

    def _part_len(self, k: int) -> int:
        return min(self._part, self._known_size - k * self._part)

    def _arrived(self, k: int) -> int:
        """Bytes of part k in its buffer so far (under the lock)."""
        return self._part_len(k) if k in self._ready else self._filled.get(k, 0)

    def _release(self, k: int) -> None:
        """Part k's buffer back to the pool once it is both read and hashed (under the lock)."""
        if k < self._read_part and k < self._next_hash and k in self._bufs:
            self._free.append(self._bufs.pop(k))
            self._ready.discard(k)
            self._filled.pop(k, None)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = e
            self._stopped = True
            self._cond.notify_all()

    def _take(self, probe: bool) -> tuple[int, bytearray] | None:
        """The next part to fetch and a buffer for it, once the window has room (under the lock)."""
        while True:
            if self._stopped:
                return None
            if self._size is None:  # the first answer (the probe) decides: ranged or whole
                if not probe or self._next_start > 0:
                    self._cond.wait()
                    continue
            elif self._sequential or self._next_start >= self._parts():
                return None
            if self._next_start < min(self._read_part, self._next_hash) + self._window:
                k = self._next_start
                self._next_start += 1
                return k, self._buffer(k)
            self._cond.wait()

    def _work(self, index: int) -> None:
        try:
            while True:
                with self._cond:
                    got = self._take(probe=index == 0)
                if got is None:
                    return
                self._fetch(*got)
        except BaseException as e:  # handed to the reader, which raises it
            self._fail(e)

    def _buffer(self, k: int) -> bytearray:
        """A buffer for part k, which the reader may read as it fills (under the lock)."""
        buf = self._free.pop() if self._free else bytearray(self._part)
        self._bufs[k], self._filled[k] = buf, 0
        return buf

    def _fetch(self, k: int, buf: bytearray) -> None:
        """Part k into buf; when it arrives short, the rest of it is asked for again."""
        why = ""
        for attempt in range(PART_ATTEMPTS):
            if attempt and not self._stopped:
                self._backoff(k, attempt, why)
            with self._cond:
                if self._stopped:
                    return
                size, have = self._size, self._filled[k]
            start = k * self._part + have
            end = k * self._part + (self._part if size is None else self._part_len(k))
            answer = self._open_range(start, end)
            try:
                if size is None:
                    size = self._decide(answer, end)
                    if size == 0:
                        return
                    if self._sequential:
                        answer = self._read_sequentially(answer, k, buf)
                        return
                    end = k * self._part + self._part_len(k)
                elif answer.total is not None and answer.total != size:
                    raise BlobCorrupt(
                        f"blob {self.name} in {self.where} is {answer.total} bytes, its index "
                        f"entry says {size}: not used"
                    )
                want = end - k * self._part
                filled = self._fill(answer, k, buf, have, want, skip=start if answer.whole else 0)
                if filled == want:
                    self._done(k, buf)
                    return
                why = f"{filled} of {want} bytes"
            except Cut as e:
                why = str(e) or "cut"
            finally:
                answer.close()
        raise self._cut_short(why)

    def _backoff(self, k: int, attempt: int, why: str) -> None:
        """Wait before asking for part k again (attempt of PART_ATTEMPTS), saying so; give up when the
        deadline leaves no time for it."""
        delay = random.uniform(0, self._backoff_s * 2**attempt)
        if not self.deadline.allows(delay):
            raise self.deadline.error(
                f"downloading part {k + 1} of blob {self.name[:12]} from {self.where} "
                f"(cut short {attempt} times: {why})"
            )
        self.deadline.retrying(attempt + 1, PART_ATTEMPTS, delay, why, f"part {k + 1} of blob {self.name[:12]}")
        time.sleep(delay)  # backoff before asking again

    def _cut_short(self, why: str) -> StoreError:
        return StoreError(
            f"the download of blob {self.name[:12]} from {self.where} was cut short {PART_ATTEMPTS} "
            f"times ({why}): check the network; not used"
        )

    def _decide(self, answer: Answer, asked_end: int) -> int:
        """The first answer tells the size, and whether the server honours ranges."""
        total = answer.total if answer.total is not None else self._expected_size
        if total is None:
            raise StoreError(f"{self.where} did not tell the size of blob {self.name[:12]}: not used")
        if self._expected_size is not None and total != self._expected_size:
            raise BlobCorrupt(
                f"blob {self.name} in {self.where} is {total} bytes, its index entry says "
                f"{self._expected_size}: not used"
            )
        with self._cond:
            self._size = total
            self._sequential = answer.whole and total > asked_end
            self._cond.notify_all()
        return total

    def _fill(self, answer: Answer, k: int, buf: bytearray, filled: int, want: int, skip: int = 0) -> int:
        """Read the answer into part k's buffer from byte filled up to want, after throwing away
        its first skip bytes; each chunk is the reader's as soon as it is in. Returns the bytes
        of the part now in the buffer."""
        view = memoryview(buf)
        speed = _LowSpeed(self.deadline.low_speed_s)
        # Skipped bytes go to a scratch buffer of their own: the part's room left may be a few bytes.
        scratch = memoryview(bytearray(min(skip, READ_CHUNK))) if skip else view
        while skip:
            n = answer.readinto(scratch[: min(skip, len(scratch))])
            if not n:
                return filled
            skip -= n
            speed.took(n)
        while filled < want:
            if self._stopped:  # closed, or another part failed: leave this one
                raise Cut("stopped")
            n = answer.readinto(view[filled : min(filled + READ_CHUNK, want)])
            if not n:
                break
            filled += n
            speed.took(n)
            with self._cond:
                self._filled[k] = filled
                self._cond.notify_all()
        return filled

    def _read_sequentially(self, answer: Answer, k: int, buf: bytearray) -> Answer:
        """A server that ignored Range: one answer, part after part, in this thread, through the
        same window. A cut is resumed by asking again from the byte it broke off at (skipping
        what a whole answer repeats). Returns the answer last open, for the caller to close."""
        failures, skip = 0, 0
        while True:
            want = self._part_len(k)
            try:
                filled = self._fill(answer, k, buf, self._filled[k], want, skip=skip)
                skip = 0
                if filled < want:
                    raise Cut(f"{filled} of {want} bytes")
            except Cut as e:
                failures += 1
                if failures >= PART_ATTEMPTS:
                    raise self._cut_short(str(e)) from None
                answer.close()
                self._backoff(k, failures, str(e))
                start = k * self._part + self._filled[k]  # only this thread changes it
                answer = self._open_range(start, self._known_size)
                skip = start if answer.whole else 0
                continue
            failures = 0
            self._done(k, buf)
            with self._cond:
                while not self._stopped and k + 1 >= min(self._read_part, self._next_hash) + self._window:
                    self._cond.wait()
                if self._stopped or k + 1 >= self._parts():
                    return answer
                k += 1
                self._next_start = k + 1
                buf = self._buffer(k)

    def _done(self, k: int, buf: bytearray) -> None:
        """Part k is whole: ready for the reader; then hash every part that is next in order,
        unless another thread is doing so (it will find this part when it gets there)."""
        with self._cond:
            self._bufs[k] = buf
            self._ready.add(k)
            self._cond.notify_all()
            if self._hashing:
                return
            self._hashing = True
        while True:
            with self._cond:
                h = self._next_hash
                if h not in self._ready or self._stopped:
                    self._hashing = False
                    self._cond.notify_all()
                    return
                view = memoryview(self._bufs[h])[: self._part_len(h)]
            self.sha256.update(view)  # outside the lock: hashlib lets other threads run meanwhile
            with self._cond:
                self._next_hash = h + 1
                self._release(h)
                self._cond.notify_all()


class _LowSpeed:
    """One connection's pace: Cut when it brings fewer than LOW_SPEED_BYTES in window seconds."""

    def __init__(self, window: float):
        self.window = window
        self.since, self.bytes = time.monotonic(), 0

    def took(self, n: int) -> None:
        self.bytes += n
        now = time.monotonic()
        if now - self.since >= self.window:
            if self.bytes < LOW_SPEED_BYTES:
                raise Cut(
                    f"{self.bytes} bytes in {now - self.since:.0f} s, under {LOW_SPEED_BYTES >> 10} KiB "
                    f"per {self.window:.0f} s (a trickle)"
                )
            self.since, self.bytes = now, 0
