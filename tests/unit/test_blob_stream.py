"""The streamed download (warmer.store.stream.BlobStream): parallel ranged reads handed on in order,
a fixed window of them in memory, the blob's digest on the same pass, short parts read again by
range, wrong bytes refused at the end; and restore's use of it (read again what the wire damaged,
refuse at once what the store really holds).

The "store" here is a function over bytes in memory whose answers can be cut short, damaged or
made to ignore Range, so that every path runs deterministically, without a network."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from warmer import restore
from warmer.errors import StoreError
from warmer.store.stream import BlobCorrupt, BlobStream, Cut

KiB = 1 << 10


class Answer:
    """Bytes [start, end) of data (or all of it, from 0, when whole), in small reads; cut after
    `cut_after` bytes when given (a reset: Cut, or a body that just ends: 0)."""

    def __init__(self, data: bytes, start: int, end: int, whole: bool = False, cut_after: int | None = None,
                 reset: bool = True):
        self.data, self.whole, self.total = data, whole, len(data)
        self.pos, self.end = (0, len(data)) if whole else (start, min(end, len(data)))
        self.stop = self.pos + cut_after if cut_after is not None else None
        self.reset = reset

    def readinto(self, view) -> int:
        end = self.end if self.stop is None else min(self.end, self.stop)
        n = min(len(view), end - self.pos, 7 * KiB)
        if n == 0 and self.stop is not None and self.pos == self.stop and self.pos < self.end and self.reset:
            raise Cut("connection reset")
        view[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        pass


class Store:
    """open_range over data, recording every range asked; faults by range start."""

    def __init__(self, data: bytes, whole: bool = False):
        self.data, self.whole = data, whole
        self.asked: list[tuple[int, int]] = []
        self.cuts: dict[int, list] = {}  # start -> [(cut_after, reset), ...] for its next answers
        self.lock = threading.Lock()

    def open_range(self, start: int, end: int) -> Answer:
        with self.lock:
            self.asked.append((start, end))
            fault = self.cuts.get(start, [])
            cut = fault.pop(0) if fault else (None, True)
        return Answer(self.data, start, end, self.whole, *cut)


def stream(store: Store, sha: str | None = None, **kw) -> BlobStream:
    kw.setdefault("part_size", 64 * KiB)
    kw.setdefault("threads", 4)
    kw.setdefault("window_bytes", 6 * 64 * KiB)
    return BlobStream(sha or hashlib.sha256(store.data).hexdigest(), store.open_range, backoff_s=0, **kw)


def read_all(s: BlobStream, sizes=(1, 5000, 64 * KiB, 100 * KiB)) -> bytes:
    out, i = bytearray(), 0
    while chunk := s.read(sizes[i % len(sizes)]):
        out += chunk
        i += 1
    return bytes(out)


@pytest.mark.parametrize("size", [0, 1, 64 * KiB, 64 * KiB + 1, 1000 * KiB + 3])
@pytest.mark.parametrize("probe_first", [False, True])
def test_the_bytes_come_in_order_and_hash_to_the_name(size, probe_first):
    store = Store(os.urandom(size))
    with stream(store, size=size, probe_first=probe_first) as s:
        assert read_all(s) == store.data
        assert s.sha256.hexdigest() == hashlib.sha256(store.data).hexdigest() and s.bytes == size
        assert s.read(10) == b""  # and stays at the end
    parts = -(-size // (64 * KiB))
    assert sorted(start for start, _ in store.asked) == [k * 64 * KiB for k in range(max(parts, 1 if probe_first else 0))]


def test_readinto_and_read_all_at_once():
    store = Store(os.urandom(300 * KiB))
    with stream(store, size=len(store.data)) as s:
        buf = bytearray(100 * KiB)
        n = s.readinto(buf)
        assert 0 < n <= len(buf) and bytes(buf[:n]) == store.data[:n]
        assert s.read() == store.data[n:]


def test_no_more_parts_are_held_than_the_window_allows():
    """The reader takes one part at a time; the threads never start a part beyond the window."""
    part, window = 16 * KiB, 4
    store = Store(os.urandom(100 * part))
    with stream(store, size=len(store.data), part_size=part, threads=8, window_bytes=window * part) as s:
        done = 0
        while chunk := s.read(part):
            done += len(chunk)
            with store.lock:
                furthest = max(start for start, _ in store.asked) // part
            # parts read so far: done // part; the one being read was released only at this call
            assert furthest < done // part + window, (furthest, done // part)
        assert done == len(store.data)


def test_a_part_cut_short_is_asked_for_again_from_where_it_broke_off():
    part = 64 * KiB
    store = Store(os.urandom(10 * part))
    store.cuts[3 * part] = [(1000, True)]          # a reset after 1000 bytes,
    store.cuts[3 * part + 1000] = [(5000, False)]  # then a body that ends early
    with stream(store, size=len(store.data)) as s:
        assert read_all(s) == store.data
    asked = sorted(store.asked)
    assert [r for r in asked if 3 * part <= r[0] < 4 * part] == [(3 * part, 4 * part), (3 * part + 1000, 4 * part),
                                                                 (3 * part + 6000, 4 * part)]
    assert all([start for start, _ in asked].count(k * part) == 1 for k in range(10) if k != 3)


def test_the_reader_takes_a_part_as_it_arrives():
    """Bytes of a part still downloading are the reader's at once: the first bytes of the blob
    are read while the rest of its first part has not been sent."""
    part = 64 * KiB
    store = Store(os.urandom(4 * part))
    sent, go_on = threading.Event(), threading.Event()
    held = store.open_range

    def open_range(start, end):
        answer = held(start, end)
        if start == 0:
            read = answer.readinto

            def readinto(view):
                if answer.pos >= 7 * KiB:  # the first chunk is out: hold the rest
                    sent.set()
                    assert go_on.wait(10)
                return read(view)
            answer.readinto = readinto
        return answer

    with BlobStream(hashlib.sha256(store.data).hexdigest(), open_range, size=len(store.data), part_size=part,
                    threads=2, window_bytes=4 * part, backoff_s=0) as s:
        assert sent.wait(10)
        assert s.read(7 * KiB) == store.data[:7 * KiB]  # part 0 is not whole yet
        go_on.set()
        assert s.read() == store.data[7 * KiB:]


def test_a_part_cut_short_every_time_fails_the_download():
    part = 64 * KiB
    store = Store(os.urandom(10 * part))
    for i in range(5):
        store.cuts[2 * part + i * 100] = [(100, True)]
    with stream(store, size=len(store.data)) as s, pytest.raises(StoreError, match="cut short 5 times"):
        read_all(s)
    assert [start for start, _ in store.asked if 2 * part <= start < 3 * part] == [2 * part + i * 100 for i in range(5)]


def test_a_server_that_ignores_range_is_read_as_one_stream_through_the_window():
    part = 64 * KiB
    store = Store(os.urandom(20 * part + 5), whole=True)
    store.cuts[0] = [(7 * part + 3, True)]  # the probe is answered with the whole blob, cut in part 7
    with stream(store, size=len(store.data), probe_first=True) as s:
        assert read_all(s) == store.data
    # the probe, then one more ask after the cut (from the byte it broke off at), nothing in parallel
    assert store.asked == [(0, part), (7 * part + 3, len(store.data))]


def test_a_resumed_whole_answer_skips_what_it_repeats_in_full_reads():
    """A cut 16 bytes before the end of a part: the resumed whole answer repeats every byte before
    the cut, skipped in reads as large as the answer gives (7 KiB here), not 16 bytes at a time
    (that was 28,000 reads for this blob; a multi-GB layer ran past any deadline)."""
    part = 64 * KiB
    store = Store(os.urandom(20 * part), whole=True)
    store.cuts[0] = [(7 * part - 16, True)]
    reads = 0
    held = store.open_range

    def open_range(start, end):
        answer = held(start, end)
        read = answer.readinto

        def readinto(view):
            nonlocal reads
            reads += 1
            return read(view)
        answer.readinto = readinto
        return answer

    with BlobStream(hashlib.sha256(store.data).hexdigest(), open_range, size=len(store.data), part_size=part,
                    threads=4, window_bytes=6 * part, probe_first=True, backoff_s=0) as s:
        assert read_all(s) == store.data
    assert store.asked == [(0, part), (7 * part - 16, len(store.data))]
    assert reads < 2 * (len(store.data) + 7 * part) // (7 * KiB) + 10, reads


def test_wrong_bytes_are_refused_at_the_end_and_drain_tells_wire_from_store():
    data = os.urandom(500 * KiB)
    damaged = bytearray(data)
    damaged[250 * KiB] ^= 1
    store = Store(bytes(damaged))
    name = hashlib.sha256(data).hexdigest()
    with stream(store, sha=name, size=len(data)) as s, pytest.raises(BlobCorrupt, match="hashed to"):
        read_all(s)
    with stream(store, sha=name, size=len(data)) as s:
        s.read(10)
        assert s.drain() is False  # not the blob's bytes: damaged on the way
    with stream(Store(data), size=len(data)) as s:
        s.read(10)
        assert s.drain() is True  # the blob's own bytes


def test_a_store_that_holds_another_size_is_refused_before_a_byte_is_read():
    store = Store(os.urandom(100 * KiB))
    with stream(store, size=99 * KiB, probe_first=True) as s, \
            pytest.raises(BlobCorrupt, match=r"is 102400 bytes, its index entry says 101376"):
        s.read(1)
    with stream(store, size=99 * KiB) as s, pytest.raises(BlobCorrupt, match="its index entry says"):
        s.read()


def test_closing_early_stops_the_threads():
    store = Store(os.urandom(200 * 64 * KiB))
    s = stream(store, size=len(store.data))
    s.read(10)
    s.close()
    assert not [t for t in threading.enumerate() if t.name == "warmer-blob-reader"]
    assert len(store.asked) < 200


# -- restore over a stream: read again what the wire damaged, refuse what the store holds -------------

def _artifact(packed):
    p = packed("streamed", extra={"inductor/ab/big.so": os.urandom(600 * KiB)})  # ten parts and more
    return p, p.path.read_bytes()


def test_a_download_damaged_on_the_way_is_read_again_and_activated(packed, tmp_path):
    p, data = _artifact(packed)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    sha = hashlib.sha256(data).hexdigest()
    served = [bytes(damaged), data]  # the first download damaged, the second whole
    opened = []

    def open_archive():
        opened.append(1)
        return stream(Store(served[len(opened) - 1]), sha=sha, size=len(data))

    got = restore.restore(p.artifact, open_archive, tmp_path / "root", archive_sha256=sha)
    assert got.status == "restored" and len(opened) == 2
    assert restore.active(tmp_path / "root").archive_sha256 == sha
    assert not [x for x in tmp_path.iterdir() if ".staging-" in x.name]


def test_bytes_damaged_on_every_download_are_refused_after_three(packed, tmp_path):
    p, data = _artifact(packed)
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0xFF
    sha = hashlib.sha256(data).hexdigest()
    opened = []

    def open_archive():
        opened.append(1)
        return stream(Store(bytes(damaged)), sha=sha, size=len(data))

    with pytest.raises(restore.RestoreError, match="hashed to .* on each of 3 downloads"):
        restore.restore(p.artifact, open_archive, tmp_path / "root", archive_sha256=sha)
    assert len(opened) == 3 and restore.active(tmp_path / "root") is None
    assert not [x for x in tmp_path.iterdir() if ".staging-" in x.name]


def test_a_bad_artifact_that_is_the_stores_own_blob_is_refused_after_one_download(packed, tmp_path):
    """A member whose bytes differ from artifact.json, in a blob that hashes to its name: the
    store holds exactly this, so reading it again cannot help."""
    p, data = _artifact(packed)
    other = packed("other")
    opened = []

    def open_archive():  # the blob of another artifact, under its own (matching) name
        opened.append(1)
        blob = other.path.read_bytes()
        return stream(Store(blob), size=len(blob))

    with pytest.raises(restore.RestoreError, match="not the one this restore was asked for"):
        restore.restore(p.artifact, open_archive, tmp_path / "root")
    assert len(opened) == 1 and restore.active(tmp_path / "root") is None


def test_restore_reads_the_blob_once(packed, tmp_path: Path):
    """One pass: every part asked for once, the archive's digest taken from the stream."""
    p, data = _artifact(packed)
    store = Store(data)
    sha = hashlib.sha256(data).hexdigest()
    got = restore.restore(p.artifact, lambda: stream(store, sha=sha, size=len(data)), tmp_path / "root",
                          archive_sha256=sha)
    assert got.status == "restored" and got.archive_bytes == len(data)
    starts = [start for start, _ in store.asked]
    assert sorted(starts) == sorted(set(starts)) and len(starts) == -(-len(data) // (64 * KiB))
