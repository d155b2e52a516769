"""The threads that write an extraction's files (Writer), and the same interface that only checks
them (Checker): extract() hands each file over as Open, Data..., Close items, or small files whole
in a batch (SmallFiles), and reads on while they are written.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import NamedTuple

from warmer.archive.common import MANIFEST_MEMBER, ArchiveError

# Threads that create and write the files of an extraction: file creation is mostly kernel
# time, and it scales past one core. More than the machine's cores only adds switching.
WRITERS = max(1, min(4, os.cpu_count() or 1))

View = memoryview | bytes  # a file's bytes as the reader hands them on: a view of its buffer, or b""


class SmallFiles(NamedTuple):
    batch: list[tuple[str, View, str, int, int]]  # (rel, view, sha256, mode, mtime_ns) of files each whole in one view


class Open(NamedTuple):
    rel: str
    want: str  # the sha256 artifact.json gives


class Data(NamedTuple):
    view: View


class Close(NamedTuple):
    mode: int
    mtime_ns: int


Item = SmallFiles | Open | Data | Close


class Writer:
    """Hashes, creates and writes the files in threads of their own: those system calls and
    the digests are most of a restore's time, and they overlap decompressing and parsing what
    comes next. Each file goes whole to one thread, the one with the least waiting (small files
    in batches); all of them together hold at most BUDGET bytes. A file is checked against its
    sha256 before it gets its mode and mtime; the first error (a digest that differs, a full
    disk) stops all threads and is raised by the next put() or by close(), so extract() never
    returns with a file unchecked."""

    FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    # Bytes handed to the threads and not yet written: the memory an extraction holds, whatever
    # the artifact's size. Shared by all threads, so that one busy with a big file does not stop
    # the others from taking the small files after it.
    BUDGET = 16 << 20
    ITEM = 4096  # what an item counts for besides its data: bounds how many small files wait
    BATCH = 256 << 10  # small files go to a thread together, up to this many bytes
    DIRS = 4096  # directories remembered: members come grouped by directory, and one forgotten costs a stat

    def __init__(self, dest: Path, threads: int) -> None:
        self.dest = os.fspath(dest)
        self.error: BaseException | None = None
        self.abort = False
        self.dirs: set[str] = set()  # made here, or known to exist; forgotten past DIRS
        self.queues: list[queue.SimpleQueue[tuple[Item | None, int]]] = [queue.SimpleQueue() for _ in range(threads)]
        self.pending = [0] * threads  # bytes waiting, per thread
        self.held = 0
        self.room = threading.Condition()
        self.lane = 0
        self.batch: list[tuple[str, View, str, int, int]] = []
        self.batch_bytes = 0
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name="warmer-extract-writer", daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def put(self, item: Item, nbytes: int = 0) -> None:
        cost = nbytes + self.ITEM
        with self.room:
            while self.error is None and self.held and self.held + cost > self.BUDGET:
                self.room.wait()
            if self.error is not None:
                raise self.error
            if isinstance(item, (SmallFiles, Open)):  # new files: to the thread with the least to do
                self.lane = min(range(len(self.pending)), key=self.pending.__getitem__)
            self.held += cost
            self.pending[self.lane] += cost
        self.queues[self.lane].put((item, cost))

    def small_file(self, rel: str, view: View, want: str, mode: int, mtime_ns: int) -> None:
        """A file whole in one view: batched with the next ones (one hand-over for many)."""
        self.batch.append((rel, view, want, mode, mtime_ns))
        self.batch_bytes += len(view) + self.ITEM
        if self.batch_bytes >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            batch, nbytes = self.batch, self.batch_bytes
            self.batch, self.batch_bytes = [], 0
            self.put(SmallFiles(batch), nbytes)

    def close(self, ok: bool) -> None:
        """Wait for every write and check; with ok=False, drop what is left."""
        if ok:
            self.flush()
        self.abort = not ok
        for q in self.queues:
            q.put((None, 0))
        for t in self.threads:
            t.join()
        self.threads = []
        if ok and self.error is not None:
            raise self.error

    def _open(self, rel: str) -> int:
        parent = rel.rpartition("/")[0]
        if parent and parent not in self.dirs:
            os.makedirs(os.path.join(self.dest, parent), exist_ok=True)
            if len(self.dirs) >= self.DIRS:  # memory flat in the number of directories
                self.dirs.clear()
            while parent and parent not in self.dirs:
                self.dirs.add(parent)
                parent = parent.rpartition("/")[0]
        return os.open(os.path.join(self.dest, rel), self.FLAGS, 0o600)

    @staticmethod
    def _write(fd: int, view: View) -> None:
        while view:
            view = view[os.write(fd, view) :]

    @staticmethod
    def _finish(fd: int, mode: int, mtime_ns: int) -> None:
        os.fchmod(fd, mode)
        os.utime(fd, ns=(mtime_ns, mtime_ns))

    def _run(self, lane: int) -> None:
        f = _OpenFile()  # the file this thread is writing
        while True:
            item, cost = self.queues[lane].get()
            if item is None:
                break
            try:
                if self.error is None and not self.abort:  # else: keep taking items, so put() never waits
                    self._do(item, f)
            except BaseException as e:  # handed to the main thread, which raises it
                if self.error is None:
                    self.error = e
                f.close()
            finally:
                with self.room:
                    self.held -= cost
                    self.pending[lane] -= cost
                    self.room.notify()
        f.close()

    def _do(self, item: Item, f: _OpenFile) -> None:
        if isinstance(item, Data):
            assert f.fd is not None  # an Open came first, on this thread
            f.sha256.update(item.view)
            self._write(f.fd, item.view)
        elif isinstance(item, Open):
            f.rel, f.want = item
            f.sha256 = hashlib.sha256()
            f.fd = self._open(f.rel)
        elif isinstance(item, SmallFiles):  # most files
            for f.rel, view, f.want, mode, mtime_ns in item.batch:
                f.sha256 = hashlib.sha256(view)
                f.fd = self._open(f.rel)
                self._write(f.fd, view)
                self._check_and_close(f, mode, mtime_ns)
        else:
            self._check_and_close(f, item.mode, item.mtime_ns)

    def _check_and_close(self, f: _OpenFile, mode: int, mtime_ns: int) -> None:
        if f.sha256.hexdigest() != f.want:
            raise ArchiveError(f"member {f.rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")
        assert f.fd is not None  # opened by _do
        self._finish(f.fd, mode, mtime_ns)
        f.close()


class _OpenFile:
    __slots__ = ("fd", "rel", "want", "sha256")

    def __init__(self) -> None:
        self.fd: int | None = None
        self.rel, self.want, self.sha256 = "", "", hashlib.sha256()  # each file starts a new one

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


class Checker:
    """The writer's interface without writing: hashes every file in this thread and compares it
    with artifact.json (what publish runs before an artifact may enter a store)."""

    threads: list[threading.Thread] = []

    def __init__(self) -> None:
        self.f = _OpenFile()

    def small_file(self, rel: str, view: View, want: str, mode: int, mtime_ns: int) -> None:
        if hashlib.sha256(view).hexdigest() != want:
            raise ArchiveError(f"member {rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")

    def put(self, item: Item, nbytes: int = 0) -> None:
        if isinstance(item, Open):
            self.f.rel, self.f.want = item
            self.f.sha256 = hashlib.sha256()
        elif isinstance(item, Data):
            self.f.sha256.update(item.view)
        elif self.f.sha256.hexdigest() != self.f.want:
            raise ArchiveError(f"member {self.f.rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")

    def flush(self) -> None:
        pass

    def close(self, ok: bool) -> None:
        pass
