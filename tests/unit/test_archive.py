import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from warmer import archive
from warmer.archive import ArchiveError, FileEntry, FileList


def _pack(root, rels, manifest_extra=None):
    body = io.BytesIO()
    entries = archive.pack_body(root, rels, body)
    manifest = json.dumps({"files": [e.to_dict() for e in entries], **(manifest_extra or {})}).encode()
    out = io.BytesIO()
    body.seek(0)
    archive.assemble(manifest, body, out)
    return out.getvalue(), entries


def _expect(entries):
    return lambda manifest: FileList.of(entries)


def test_round_trip_keeps_bytes_modes_and_mtimes(cache_tree, tmp_path):
    root, files = cache_tree
    so = "inductor/24/c244b2rga7kqcbbf2xhybporem2yeo55qusvywqyipbcdmkdmkrr.so"
    (root / so).chmod(0o4755)  # setuid must not survive
    data, entries = _pack(root, sorted(files))
    dest = tmp_path / "dest"
    dest.mkdir()
    got = archive.extract(io.BytesIO(data), dest, _expect(entries), 1 << 30)
    assert got.files == len(files)
    assert json.loads(archive.read_manifest(io.BytesIO(data)))["files"][0]["path"] == sorted(files)[0]
    for rel, content in files.items():
        assert (dest / rel).read_bytes() == content
        assert (dest / rel).stat().st_mtime_ns == (root / rel).stat().st_mtime_ns
    assert (dest / so).stat().st_mode & 0o7777 == 0o755
    assert got.archive_bytes == len(data)


@pytest.mark.skipif(not shutil.which("tar"), reason="GNU tar is not installed")
def test_gnu_tar_opens_the_archive(cache_tree, tmp_path):
    root, files = cache_tree
    data, _ = _pack(root, sorted(files))
    path = tmp_path / "a.tar.zst"
    path.write_bytes(data)
    listing = subprocess.run(["tar", "--zstd", "-tf", str(path)], capture_output=True, text=True, check=True).stdout
    # in the order given, but for the largest file, last: what a fetch has left to unpack when
    # the last byte lands is then a piece of one big file, not many small ones
    largest = max(sorted(files), key=lambda rel: len(files[rel]))
    assert len(files[largest]) > max(len(c) for r, c in files.items() if r != largest)
    in_order = [archive.MANIFEST_MEMBER] + [rel for rel in sorted(files) if rel != largest] + [largest]
    assert listing.split() == in_order
    assert [f["path"] for f in json.loads(archive.read_manifest(io.BytesIO(data)))["files"]] == in_order[1:]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(path), "-C", str(out)], check=True)
    assert all((out / rel).read_bytes() == content for rel, content in files.items())


def test_replace_manifest_keeps_the_files(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files))
    path = tmp_path / "a.tar.zst"
    path.write_bytes(data)
    archive.replace_manifest(path, b'{"stamped": true}')
    with open(path, "rb") as f:
        assert archive.read_manifest(f) == b'{"stamped": true}'
    dest = tmp_path / "d"
    dest.mkdir()
    with open(path, "rb") as f:
        archive.extract(f, dest, _expect(entries), 1 << 30)
    assert all((dest / rel).read_bytes() == c for rel, c in files.items())


def test_changed_file_is_refused(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files))
    lying = [FileEntry(e.path, e.size, "0" * 64, e.mode, e.mtime_ns) if e.path.endswith(".so") else e
             for e in entries]
    with pytest.raises(ArchiveError, match="sha256 differs"):
        archive.extract(io.BytesIO(data), tmp_path, _expect(lying), 1 << 30)


def test_truncated_archive_is_refused(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files))
    with pytest.raises(ArchiveError):
        archive.extract(io.BytesIO(data[: len(data) // 2]), tmp_path, _expect(entries), 1 << 30)


def test_unlisted_member_is_refused(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files))
    fewer = [e for e in entries if not e.path.endswith(".gch")]
    with pytest.raises(ArchiveError, match="not listed"):
        archive.extract(io.BytesIO(data), tmp_path, _expect(fewer), 1 << 30)


def test_missing_member_is_refused(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files)[:-1])
    more = entries + [FileEntry("inductor/extra.so", 1, "0" * 64, 0o644, 0)]
    with pytest.raises(ArchiveError, match="missing"):
        archive.extract(io.BytesIO(data), tmp_path, _expect(more), 1 << 30)


def test_size_limit(cache_tree, tmp_path):
    root, files = cache_tree
    data, entries = _pack(root, sorted(files))
    with pytest.raises(ArchiveError, match="over the limit"):
        archive.extract(io.BytesIO(data), tmp_path, _expect(entries), 1000)


def _hostile(tmp_path, build):
    """An archive whose manifest frame is valid and whose body is built by hand."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        build(tf)
    return archive.manifest_frame(b"{}") + zstandard.ZstdCompressor().compress(raw.getvalue())


@pytest.mark.parametrize("name", ["../escape.so", "/etc/passwd", "inductor/../../x"])
def test_paths_outside_the_root_are_refused(tmp_path, name):
    def build(tf):
        info = tarfile.TarInfo(name)
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    data = _hostile(tmp_path, build)
    dest = tmp_path / "d"
    dest.mkdir()
    passwd = Path("/etc/passwd").read_bytes()
    with pytest.raises(ArchiveError, match="refused"):
        archive.extract(io.BytesIO(data), dest, lambda m: FileList.of([]), 1 << 30)
    # Nothing written, in dest or above it (../escape.so, inductor/../../x land in tmp_path).
    assert [p.name for p in tmp_path.rglob("*")] == ["d"]
    assert Path("/etc/passwd").read_bytes() == passwd


def test_links_are_refused(tmp_path):
    def build(tf):
        info = tarfile.TarInfo("inductor/link")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tf.addfile(info)
    data = _hostile(tmp_path, build)
    with pytest.raises(ArchiveError, match="only regular files"):
        archive.extract(io.BytesIO(data), tmp_path,
                        lambda m: FileList.of([FileEntry("inductor/link", 0, "0" * 64, 0o644, 0)]), 1 << 30)


def test_not_a_warmer_archive(tmp_path):
    with pytest.raises(ArchiveError):
        archive.read_manifest(io.BytesIO(b"not zstd at all"))
