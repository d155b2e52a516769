"""artifact.json's files held as their bytes, compressed (archive.FileList), and read without
being parsed into objects (artifact.load): what lets a fetch's memory stay flat as the file
count grows. A node once held every entry parsed, 1.3 KiB a file (103 MiB for 45,000 files of
2 KB, against 49 MiB for 3,000); artifact.json's bytes are about 210 a file, and 60 compressed."""

from __future__ import annotations

import hashlib
import io
import json
import tracemalloc

import pytest
import tarfile
import zstandard

from tests.fixtures import nodes
from warmer import archive, restore
from warmer.archive import FileEntry, FileList
from warmer.artifact import Artifact, ArtifactError, RecipeRef
from warmer.contract import PathContract
from warmer.entry import BlobRef, EntryError, IndexEntry
from warmer.untrusted import InvalidDocument

SHA = hashlib.sha256(b"x").hexdigest()
ODD = ['inductor/a"quote', "inductor/ü-é", "inductor/tab\there", "inductor/del\x7f", "inductor/[x],{y}"]


def _entries(n: int) -> list[FileEntry]:
    return [FileEntry(f"inductor/{i % 256:02x}/c{i:06d}kernel.so", i, SHA, 0o644, 1_790_000_000_000_000_000 + i)
            for i in range(n)] + [FileEntry(p, 7, SHA, 0o755, 0) for p in ODD]


def _artifact(entries: list[FileEntry], **identity) -> Artifact:
    return Artifact.new(key="a" * 64, recipe=RecipeRef("tiny", "0" * 64, {"name": "tiny", **identity}),
                        fingerprint=nodes.gpu_node("h200"),
                        path_contract=PathContract(root="/cache/root", model="/models/tiny", python_prefix="/opt/venv"),
                        components={}, files=entries, timings={})


def _list_bytes(docs: list) -> bytes:
    return json.dumps(docs, sort_keys=True, separators=(",", ":")).encode()


def test_a_file_list_gives_back_what_it_was_made_of():
    entries = _entries(300)
    files = FileList.of(entries)
    assert list(files) == entries and list(files) == entries  # walked again, the same
    assert len(files) == len(entries) and files.total_bytes == sum(e.size for e in entries)
    assert files.by_path()["inductor/ü-é"].mode == 0o755 and files.unsafe is None
    assert list(files.sizes()) == [(e.path, e.size) for e in entries]
    assert files.any_under("inductor/ü") and files.any_under('inductor/a"q') and not files.any_under("inductor/ü-x")
    assert FileList.of([]).count == 0 and list(FileList.of([])) == [] == list(FileList.of([]).sizes())


def test_a_list_of_many_pieces_is_walked_whole_one_piece_at_a_time():
    """A walk decompresses the list a megabyte at a time, cut after an entry: every entry comes
    back, whichever piece it is in, and the pieces together are the list's bytes."""
    entries = _entries(20_000)  # 4 MiB of JSON
    files = FileList.of(entries)
    pieces = list(files.pieces())
    assert len(pieces) > 2 and b"".join(pieces) == FileList.json_of(entries) == files.json()
    assert all(p.endswith(b"}") for p in pieces[:-1]) and all(p.startswith(b',{"mode":') for p in pieces[1:])
    assert list(files) == entries and list(files.sizes()) == [(e.path, e.size) for e in entries]
    assert files.any_under("inductor/ff/c019967") and not files.any_under("inductor/ff/c019968")
    assert files == FileList.of(entries) and files != FileList.of(entries[:-1])


def test_paths_that_share_a_hash_are_compared_before_one_is_called_a_repeat(monkeypatch):
    """A path listed twice is found from 8 bytes a file (its hash, in one buffer); two paths with
    one hash are then compared whole, so a collision is never taken for a repeat."""
    entries = _entries(50)
    hashed = []
    monkeypatch.setattr(archive.filelist, "hash", lambda x: hashed.append(x) or 42, raising=False)  # all collide
    assert list(FileList.of(entries)) == entries
    assert len(hashed) == len(entries)  # the collisions were met: the fast reader hashes each entry with hash()
    with pytest.raises(InvalidDocument, match="lists 'inductor/05/c000005kernel.so' twice"):
        FileList.of(entries + entries[5:6])
    other_form = json.dumps([e._asdict() for e in entries + entries[5:6]]).encode()  # walked with json
    with pytest.raises(InvalidDocument, match="lists 'inductor/05/c000005kernel.so' twice"):
        FileList.parse(other_form, 0, len(other_form), "files")
    other_form = json.dumps([e._asdict() for e in entries]).encode()
    hashed.clear()
    assert list(FileList.parse(other_form, 0, len(other_form), "files")) == entries
    assert [x for x in hashed if isinstance(x, str)] == [e.path for e in entries]  # and so does the json walk


def test_entries_in_another_form_are_read_as_json_reads_them():
    """A field a newer warmer added, keys in another order, an escape json.dumps does not write:
    not the form the fast reader takes, read all the same."""
    entries = _entries(3)
    docs = [{**e._asdict(), "xattrs": {}} for e in entries[:2]] + [e._asdict() for e in entries[2:]]
    for raw in (_list_bytes(docs), json.dumps([e._asdict() for e in entries]).encode(),
                _list_bytes([e._asdict() for e in entries]).replace(b"inductor/00", b"\\u0069nductor/00", 1)):
        got = FileList.parse(raw, 0, len(raw), "files")
        assert list(got) == entries and got.total_bytes == sum(e.size for e in entries)
        assert list(got.sizes()) == [(e.path, e.size) for e in entries]
        assert got.any_under("inductor/tab\t") and not got.any_under("vllm/")


@pytest.mark.parametrize("bad, message", [
    ({"path": "../x"}, r"files\[1\]\.path.*refused"),
    ({"path": "/etc/passwd"}, r"files\[1\]\.path"),
    ({"path": "a\u0000b"}, r"files\[1\]\.path"),
    ({"mode": 0o10000}, r"files\[1\]\.mode is 4096, outside"),
    ({"size": -1}, r"files\[1\]\.size is -1"),
    ({"size": 2 ** 63}, r"files\[1\]\.size"),
    ({"mtime_ns": 2 ** 63}, r"files\[1\]\.mtime_ns"),
    ({"sha256": "0" * 63}, r"files\[1\]\.sha256 must be 64"),
    ({"sha256": 5}, r"files\[1\]\.sha256 must be a string"),
    ({"path": "inductor/00/c000000kernel.so"}, "lists 'inductor/00/c000000kernel.so' twice"),
])
def test_each_bad_entry_is_named(bad, message):
    docs = [e._asdict() for e in _entries(3)]
    docs[1].update(bad)
    raw = _list_bytes(docs)
    with pytest.raises(InvalidDocument, match=message):
        FileList.parse(raw, 0, len(raw), "files")


def test_an_index_entry_is_read_without_its_files_parsed():
    art = _artifact([e._replace(sha256=hashlib.sha256(e.path.encode()).hexdigest()) for e in _entries(20_000)])
    data = IndexEntry.new(art, BlobRef("b" * 64, 1), None).to_bytes()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        got = IndexEntry.read(data, "tiny", "a" * 64)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.artifact == art and got.artifact.canonical == art.canonical
    assert list(got.artifact.files) == list(art.files)
    assert list(got.artifact.files.sizes()) == [(e.path, e.size) for e in art.files]  # read in 1 MiB chunks
    # Parsed, the entries took 5 times their bytes, and then their bytes whole took 1.0 times;
    # now their bytes compressed are what is held (0.3 times: the digests do not compress), and
    # the compressor's output buffer, the size of its input, is what the reading takes.
    assert held - before < 0.45 * len(data), (held - before, len(data))
    assert peak - before < 1.5 * len(data), (peak - before, len(data))


def test_the_parse_reads_what_json_reads_whatever_the_entry_holds():
    """The fast reader cuts the files list out and parses the rest: an entry that hides a second
    list where it looks first, or lists files twice (JSON keeps the last), is read as json.loads
    reads it, and the signature is over those bytes."""
    real, decoy = _entries(4), [FileEntry("inductor/decoy", 1, SHA, 0o644, 0)]
    art = _artifact(real)
    data = IndexEntry.new(art, BlobRef("b" * 64, 1), None).to_bytes()
    decoy_json = _list_bytes([e._asdict() for e in decoy])
    twice = data.replace(b'"files":[', b'"files":' + decoy_json + b',"files":[', 1)
    assert IndexEntry.read(twice, "tiny", "a" * 64).artifact == art
    listed_last = data.replace(b',"fingerprint":', b',"files":' + decoy_json + b',"fingerprint":', 1)
    assert [e.path for e in IndexEntry.read(listed_last, "tiny", "a" * 64).artifact.files] == ["inductor/decoy"]
    # an escape json.dumps does not write: parsed whole, and artifact.json is its canonical bytes again
    escaped = IndexEntry.read(data.replace(b'"path":"inductor/00', b'"path":"\\u0069nductor/00', 1), "tiny", "a" * 64)
    assert escaped.artifact == art and escaped.artifact.canonical == art.canonical
    # a files list inside the recipe's identity, ahead of the artifact's own
    nested = _artifact(real, files=[e._asdict() for e in decoy])
    doc = json.loads(IndexEntry.new(nested, BlobRef("b" * 64, 1), None).to_bytes())
    doc["artifact"] = {"recipe": doc["artifact"].pop("recipe"), **doc["artifact"]}
    moved = json.dumps(doc, separators=(",", ":")).encode()
    assert moved.index(b'"files":[') < moved.index(b'"path":"inductor/00')
    got = IndexEntry.read(moved, "tiny", "a" * 64).artifact
    assert got == nested and list(got.files) == real and got.recipe.identity["files"][0]["path"] == "inductor/decoy"
    # the stand-in is warmer's own: a document that holds it is refused, not spliced
    with pytest.raises(EntryError, match="reserves"):
        IndexEntry.read(data.replace(b'"name":"tiny"}', b'"name":"tiny","x":["\\u0000warmer:files"]}', 1),
                        "tiny", "a" * 64)
    with pytest.raises(ArtifactError, match="twice"):
        _artifact(real + real[:1])


def _archive(entries_in_pack_order: list[FileEntry], listed: list[FileEntry], files: dict[str, bytes]) -> bytes:
    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries_in_pack_order:
            info = tarfile.TarInfo(e.path)
            info.size, info.mode, info.mtime = e.size, e.mode, 0
            tf.addfile(info, io.BytesIO(files[e.path]))
    manifest = json.dumps({"files": [e._asdict() for e in listed]}).encode()
    return archive.manifest_frame(manifest) + zstandard.ZstdCompressor().compress(body.getvalue())


def test_members_in_the_manifests_order_are_checked_without_a_table(tmp_path, monkeypatch):
    files = {f"inductor/{i}.so": bytes([i]) * (i + 1) for i in range(50)}
    entries = [FileEntry(p, len(d), hashlib.sha256(d).hexdigest(), 0o644, 0) for p, d in files.items()]
    data = _archive(entries, entries, files)
    with monkeypatch.context() as m:
        m.setattr(FileList, "by_path", lambda self: pytest.fail("a table of the files was built"))
        got = archive.extract(io.BytesIO(data), tmp_path / "a", lambda _: FileList.of(entries), 1 << 30)
    assert got.files == 50 and (tmp_path / "a/inductor/49.so").read_bytes() == files["inductor/49.so"]
    # an archive packed in another order than its manifest lists (no warmer does): still every member checked
    shuffled = entries[25:] + entries[:25]
    got = archive.extract(io.BytesIO(_archive(shuffled, entries, files)), tmp_path / "b",
                          lambda _: FileList.of(entries), 1 << 30)
    assert got.files == 50 and (tmp_path / "b/inductor/0.so").read_bytes() == files["inductor/0.so"]
    for members, message in ((shuffled + shuffled[:1], "appears twice"), (shuffled[:-1], "1 file.*missing.*'inductor/24.so'"),
                             (entries[:-1], "1 file.*missing.*'inductor/49.so'"), (entries + entries[-1:], "appears twice")):
        with pytest.raises(archive.ArchiveError, match=message):
            archive.extract(io.BytesIO(_archive(members, entries, files)), None, lambda _: FileList.of(entries), 1 << 30)


def test_a_restore_compares_the_archives_artifact_json_without_holding_it(packed, tmp_path):
    """The archive's own artifact.json is compared with the index's as it streams by; one in
    another byte form is parsed and must still be the same artifact."""
    p = packed("a")
    got = restore.restore_file(p.path, tmp_path / "root")
    assert got.status == "restored"
    other_form = json.dumps(p.artifact.to_json(), indent=1).encode()
    assert other_form != p.artifact.canonical
    assert _files_of(p.artifact, other_form) is p.artifact.files
    assert _files_of(p.artifact, p.artifact.canonical) is p.artifact.files
    for wrong in (packed("b").artifact.canonical, p.artifact.canonical[:-10],
                  p.artifact.canonical.replace(b'"size":', b'"size":1', 1)):
        with pytest.raises((archive.ArchiveError, ArtifactError), match="not the one|not valid JSON"):
            _files_of(p.artifact, wrong)


def _files_of(art, manifest: bytes):
    """restore's check of an archive's artifact.json, fed it in pieces of 1000 bytes."""
    return restore._files_of(art, iter([memoryview(manifest)[i:i + 1000] for i in range(0, len(manifest), 1000)]))


def test_an_oci_config_enters_the_entry_as_its_bytes_only_when_it_is_one_object():
    """An OCI store's entry carries the config blob (artifact.json) as its bytes, so that the
    node's reader finds the files list unparsed; bytes that are not one JSON object (one that
    would add fields to the entry, say) are refused, never spliced in: an unreadable entry."""
    from warmer.store import UnreadableEntry
    from warmer.store.oci import ANN_CREATED, ANN_KEY, ANN_RECIPE, LAYER_TYPE, OCIStore
    art = _artifact(_entries(5))
    store = OCIStore("oci://127.0.0.1:1/warmer")
    manifest = {"annotations": {ANN_RECIPE: "tiny", ANN_KEY: "a" * 64, ANN_CREATED: "2026-12-03T00:00:00+00:00"},
                "layers": [{"mediaType": LAYER_TYPE, "digest": "sha256:" + "b" * 64, "size": 1}]}
    data = store._entry(manifest, art.canonical, "entry")
    assert art.canonical.rstrip(b"\n") in data
    assert IndexEntry.read(data, "tiny", "a" * 64).artifact == art
    for bad in (b'{"a":1},"recipe":"other"', b"[1]", b'"x"', b"{", art.canonical + b"{}"):
        with pytest.raises(UnreadableEntry, match="unreadable"):
            store._entry(manifest, bad, "entry")


def test_a_marker_is_matched_to_the_artifact_by_its_digest_not_by_its_bytes(packed, tmp_path):
    """A restore writes its marker in pieces, and a no-op fetch matches the marker's tail to the
    artifact it expects by their sha256 (the artifact's id): neither is made whole. A marker whose
    artifact.json differs by one byte is parsed instead, and refused."""
    p = packed("a")
    root = tmp_path / "root"
    assert restore.restore_file(p.path, root).status == "restored"
    data = (root / restore.MARKER).read_bytes()
    assert data.endswith(b',"artifact":' + p.artifact.canonical.rstrip(b"\n") + b"}")
    assert restore.Marker.from_bytes(data, "marker", expect=p.artifact).artifact is p.artifact
    assert restore.active(root).to_bytes() == data  # parsed whole, the same bytes
    changed = data.replace(b'"size":', b'"size":1', 1)
    with pytest.raises(InvalidDocument, match="artifact_id does not match"):
        restore.Marker.from_bytes(changed, "marker", expect=p.artifact)
    assert restore.Marker.from_bytes(data, "marker", expect=packed("b").artifact).artifact == p.artifact
