"""pack_body: the archive is exactly the tar stream of the files, each digest that of the bytes
archived, whatever the sizes around the buffer and block edges; a file that changes while it is
packed, a link, and a write that fails are refused."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile

import pytest
import zstandard

from warmer import archive


def _tree(root, sizes):
    files = {}
    for i, n in enumerate(sizes):
        rel = f"d{i % 3}/f{i}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(n)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


# Sizes around the buffer and block edges: empty, one byte, a block, a buffer, buffers and a bit.
SIZES = [0, 1, 511, 512, 513, archive.CHUNK - 1, archive.CHUNK, archive.CHUNK + 1,
         3 * archive.CHUNK + 700, 10, 0, 4096] + [300] * 40


def test_the_archive_is_the_tar_stream_of_the_files(tmp_path):
    files = _tree(tmp_path / "src", SIZES)
    out = io.BytesIO()
    entries = archive.pack_body(tmp_path / "src", list(files), out)
    largest = max(files, key=lambda rel: len(files[rel]))
    in_order = [rel for rel in files if rel != largest] + [largest]  # the largest last (see archive)
    assert [e.path for e in entries] == in_order
    for e in entries:
        assert e.size == len(files[e.path]) and e.sha256 == hashlib.sha256(files[e.path]).hexdigest()
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(out.getvalue())
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        members = tf.getmembers()
        assert [m.name for m in members] == in_order
        assert all(tf.extractfile(m).read() == files[m.name] for m in members)
    # Exactly the tar stream: header, data, padding, end blocks.
    expected = b"".join(archive.tarwrite._member_header(e.path, e.size, os.stat(tmp_path / "src" / e.path).st_mode,
                                                         e.mtime_ns) + files[e.path] + archive.tarwrite._padding(e.size)
                        for e in entries) + bytes(2 * archive.BLOCK)
    assert raw == expected


def test_gnu_tar_reads_it(tmp_path):
    files = _tree(tmp_path / "src", SIZES)
    art = tmp_path / "a.tar.zst"
    with open(art, "wb") as f:
        archive.pack_body(tmp_path / "src", list(files), f)
    dest = tmp_path / "dest"
    dest.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(art), "-C", str(dest)], check=True)
    assert all((dest / rel).read_bytes() == data for rel, data in files.items())


def test_a_file_that_changes_while_packed_is_refused(tmp_path, monkeypatch):
    files = _tree(tmp_path / "src", [5000, 2 * archive.CHUNK, 100])
    grown = list(files)[1]
    real_lstat = os.lstat

    def lstat_then_grow(path, *a, **k):  # the file grows between lstat and the read (a warm-up still writing)
        got = real_lstat(path, *a, **k)
        if str(path).endswith(grown):
            with open(path, "ab") as f:
                f.write(b"more")
        return got

    monkeypatch.setattr(os, "lstat", lstat_then_grow)
    with pytest.raises(archive.ArchiveError, match=f"{grown}: changed while it was packed"):
        archive.pack_body(tmp_path / "src", list(files), io.BytesIO())


def test_a_link_is_refused(tmp_path):
    files = _tree(tmp_path / "src", [10, 10])
    os.symlink("/etc/passwd", tmp_path / "src" / "d0" / "link")
    with pytest.raises(archive.ArchiveError, match="d0/link: not a regular file"):
        archive.pack_body(tmp_path / "src", [*files, "d0/link"], io.BytesIO())


def test_an_error_writing_the_archive_is_raised(tmp_path):
    files = _tree(tmp_path / "src", [archive.CHUNK] * 20)

    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        archive.pack_body(tmp_path / "src", list(files), Full())


GOOD = {"path": "inductor/ab/k.so", "size": 10, "sha256": "a" * 64, "mode": 0o644, "mtime_ns": 1}


@pytest.mark.parametrize("bad", [
    {"size": True}, {"size": -1}, {"size": 1.0}, {"size": 2 ** 63}, {"mode": 0o10000}, {"mtime_ns": -1},
    {"sha256": "A" * 64}, {"sha256": "a" * 63}, {"sha256": "a" * 64 + "\n"}, {"path": "../x"}, {"path": "/etc/x"},
    {"path": "a//b"}, {"path": "a/./b"}, {"path": "a\0b"}, {"path": ""}, {"path": "x" * 4097}, {"path": 3},
    {"sha256": None}, {"mode": "644"},
])
def test_a_file_entry_is_refused_unless_every_field_is_usable(bad):
    from warmer.untrusted import Fields, InvalidDocument

    with pytest.raises(InvalidDocument):
        archive.FileEntry.from_json(Fields({**GOOD, **bad}, "artifact.files[0]"))
    missing = dict(GOOD)
    missing.pop(next(iter(bad)))
    with pytest.raises(InvalidDocument):
        archive.FileEntry.from_json(Fields(missing, "artifact.files[0]"))
    assert archive.FileEntry.from_json(Fields(GOOD, "f")) == archive.FileEntry("inductor/ab/k.so", 10, "a" * 64, 0o644, 1)
