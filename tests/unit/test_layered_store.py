"""Layered entries in a store (issue 30): one blob per cache component, each stored once whatever
number of entries name it. ls counts the bytes stored against what they would take unshared; gc
and rm never delete a layer another entry still names. Real packs, a real file store, the CLI as
users run it."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone

import pytest

from tests.conftest import run_warmer, tiny_recipe, write_tiny_recipe
from warmer import api, build, catalog, fetch
from warmer.cli import inspect as cli_inspect
from warmer.cli import ls as cli_ls
from warmer.entry import IndexEntry
from warmer.store import StoreError, open_store

VLLM_FILE = "vllm/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"


def cli(*args) -> dict | list:
    out = run_warmer(*args, "--json")
    assert out.returncode == 0, f"warmer {' '.join(map(str, args))}: {out.stderr[-3000:]}"
    return json.loads(out.stdout)


def blobs_in(store) -> set[str]:
    return {b.sha256 for b in store.list_blobs()}


@pytest.fixture
def two(packed, tmp_path):
    """Two artifacts of the tiny recipe (two keys: another max_model_len) from the same files but
    vllm/'s, published in layers to one file store, the second after the first."""
    a = packed("a")
    src_b = tmp_path / "src-b"
    shutil.copytree(a.source, src_b)  # copy2: the same bytes, modes and mtimes
    (src_b / VLLM_FILE).write_bytes(b'{"arch": "llama", "changed": true}')
    path_b = tmp_path / "b.tar.zst"
    art_b = build.pack_root(src_b, tiny_recipe(max_model_len=256), path_b, fp=a.artifact.fingerprint)
    store = open_store(f"file://{tmp_path / 'store'}")
    first = build.publish(store, a.path, layers=True)
    second = build.publish(store, path_b, layers=True)
    return store, a.artifact, art_b, first, second, path_b


def layer(art, component):
    found = art.layer(component)
    assert found is not None, component
    return found


def test_the_second_publish_uploads_only_the_layer_that_changed(two):
    store, art_a, art_b, first, second, _ = two
    assert art_a.key != art_b.key and art_a.recipe.name == art_b.recipe.name == "tiny"
    assert first.status == second.status == "published"
    assert first.layers == {c: True for c in art_a.components}
    assert second.layers == {c: c == "vllm" for c in art_b.components}
    assert second.bytes_uploaded == layer(art_b, "vllm").size
    for art in (art_a, art_b):  # each entry is layered and names its own layers
        entry = IndexEntry.read(store.get_index("tiny", art.key), "tiny", art.key)
        assert entry.layered and entry.blob is None
        assert [b.sha256 for b in entry.blobs] == [x.sha256 for x in art.layers]
    assert blobs_in(store) == {x.sha256 for x in art_a.layers + art_b.layers}
    assert len(blobs_in(store)) == len(art_a.layers) + 1


def test_ls_shows_the_bytes_stored_against_the_bytes_unshared(two):
    store, art_a, art_b, _, _, _ = two
    listed = cli("ls", "--store", store.url)
    rows = [d for d in listed if "key" in d]
    [summary] = [d for d in listed if "stored_bytes" in d]
    assert listed[-1] == summary and not [d for d in listed if "orphan_blob" in d]
    unshared = sum(x.size for x in art_a.layers + art_b.layers)
    stored = sum(x.size for x in art_a.layers) + layer(art_b, "vllm").size
    assert summary == {"artifacts": 2, "blobs": len(art_a.layers) + 1, "stored_bytes": stored,
                       "unshared_bytes": unshared, "shared_blobs": len(art_a.layers) - 1}
    assert summary["stored_bytes"] < summary["unshared_bytes"]
    for art in (art_a, art_b):
        [row] = [r for r in rows if r["key"] == art.key]
        assert row["blob"] is None and row["archive_bytes"] == sum(x.size for x in art.layers)
        assert [(x["component"], x["sha256"], x["shared"]) for x in row["layers"]] == \
            [(x.component, x.sha256, x.component != "vllm") for x in art.layers]
        assert row["shared_bytes"] == sum(x.size for x in art.layers if x.component != "vllm")

    text = cli_ls.report(catalog.ls(store))
    assert f"{stored / 1e6:.1f} MB stored in {len(art_a.layers) + 1} blob(s)" in text
    assert f"{len(art_a.layers) - 1} blob(s) shared by more than one entry" in text
    assert f"{len(art_a.layers)} layers, {len(art_a.layers) - 1} shared" in text


def test_inspect_and_explain_show_a_layered_entrys_layers(two, tmp_path):
    store, art_a, _, _, _, _ = two
    shown = cli("inspect", f"{store.url}/index/tiny/{art_a.key[:16]}")
    assert shown["blob"] is None
    assert [(x["component"], x["sha256"], x["size"]) for x in shown["layers"]] == \
        [(x.component, x.sha256, x.size) for x in art_a.layers]
    text = run_warmer("inspect", f"{store.url}/index/tiny/{art_a.key[:16]}").stdout
    for x in art_a.layers:
        assert f"{x.component}" in text and x.sha256[:12] in text
    entry = catalog.read_entry(f"{store.url}/index/tiny/{art_a.key}")
    assert f"layers:     {len(art_a.layers)} blob(s)" in cli_inspect.report(api.Inspection(art_a, entry))

    explained = cli("explain", write_tiny_recipe(tmp_path / "tiny.toml"), "--store", store.url)
    [c] = [c for c in explained["candidates"] if c["key"] == art_a.key]
    assert c["blob"] is None
    assert [(x["component"], x["sha256"], x["size"]) for x in c["stored_layers"]] == \
        [(x.component, x.sha256, x.size) for x in art_a.layers]


def test_gc_keeps_every_layer_while_both_entries_name_them(two):
    store, art_a, art_b, _, _, _ = two
    before = blobs_in(store)
    kept = cli("gc", "--store", store.url, "--keep", "2")
    assert kept["deleted_entries"] == [] and kept["deleted_blobs"] == [] and blobs_in(store) == before
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(hours=1)
    assert catalog.gc(store, 2, now=later).deleted_blobs == ()  # named layers are never orphans, however old

    # --keep 1: the older entry goes, and of its layers only the one no entry left names.
    newer, older = sorted((art_a, art_b), key=lambda a: IndexEntry.read(
        store.get_index("tiny", a.key), "tiny", a.key).published_at.isoformat() + a.key, reverse=True)
    plan = cli("gc", "--store", store.url, "--keep", "1", "--dry-run")
    assert [e["key"] for e in plan["deleted_entries"]] == [older.key]
    assert plan["deleted_blobs"] == [layer(older, "vllm").sha256]
    assert set(plan["shared_kept"]) == {x.sha256 for x in older.layers if x.component != "vllm"}
    assert blobs_in(store) == before  # a dry run
    done = cli("gc", "--store", store.url, "--keep", "1")
    assert done["deleted_blobs"] == [layer(older, "vllm").sha256]
    assert done["freed_bytes"] == layer(older, "vllm").size
    assert blobs_in(store) == {x.sha256 for x in newer.layers}
    assert store.list_index() == [("tiny", newer.key)]


def test_gc_names_an_entry_published_while_it_ran_that_lost_a_layer_to_it(two, tmp_path, packed):
    """A layered publish that runs wholly inside gc (after gc's last look at the index, before its
    deletes) skips the layer of the entry gc drops, finds it still there on its own check, and says
    published; gc then deletes it. No lock orders the two: gc looks at the index once more after its
    deletes, and names the entry that lost a layer, with the fix, in a failing exit."""
    from warmer.cli import gc as cli_gc
    from warmer.store.file import FileStore

    store, art_a, art_b, _, _, path_b = two
    newer, older = sorted((art_a, art_b), key=lambda a: IndexEntry.read(
        store.get_index("tiny", a.key), "tiny", a.key).published_at.isoformat() + a.key, reverse=True)
    doomed = layer(older, "vllm").sha256
    source = packed("a").source if older is art_a else tmp_path / "src-b"
    third = tmp_path / "third.tar.zst"  # another key, whose vllm layer is the older entry's
    art_c = build.pack_root(source, tiny_recipe(max_model_len=512), third, fp=older.fingerprint)
    assert layer(art_c, "vllm").sha256 == doomed

    class PublishedDuring(FileStore):
        """gc's store: a publisher's whole run lands in gc's listing of the blobs."""
        published = None

        def list_blobs(self):
            if self.published is None:
                self.published = build.publish(open_store(store.url), third, layers=True)
            return super().list_blobs()

    gc_store = PublishedDuring(str(store.base))
    done = catalog.gc(gc_store, 1)
    assert gc_store.published.status == "published" and not gc_store.published.layers["vllm"]  # it skipped it
    assert doomed in done.deleted_blobs and doomed not in blobs_in(store)
    assert done.raced == (("tiny", art_c.key, doomed),)
    said = cli_gc.report(done)
    assert f"damaged: tiny {art_c.key[:16]} was published while gc ran and names blob {doomed[:16]}" in said
    assert "publish that artifact file again" in said
    assert build.publish(store, third).status == "mended" and doomed in blobs_in(store)


def test_rm_names_an_entry_published_while_it_ran_that_lost_a_layer_to_it(two, tmp_path, monkeypatch, capsys):
    """As with gc: a layered publish of another key that lands after rm read the other entries, and
    before its deletes, skips the layer rm then deletes, and says published. rm looks at the index
    once more after its deletes, and names the entry, with the fix, in a failing exit."""
    from warmer import cli
    from warmer.store.file import FileStore

    store, _, art_b, _, _, _ = two
    doomed = layer(art_b, "vllm").sha256
    third = tmp_path / "third.tar.zst"  # another key, whose vllm layer is the removed entry's
    art_c = build.pack_root(tmp_path / "src-b", tiny_recipe(max_model_len=512), third, fp=art_b.fingerprint)
    assert layer(art_c, "vllm").sha256 == doomed
    published = []
    delete_index = FileStore.delete_index

    def publish_meanwhile(self, recipe, key):  # rm's first delete: it has read every other entry
        published.append(build.publish(open_store(store.url), third, layers=True))
        return delete_index(self, recipe, key)

    monkeypatch.setattr(FileStore, "delete_index", publish_meanwhile)
    code = cli.main(["rm", f"{store.url}/index/tiny/{art_b.key}", "--yes", "--json"])
    said = capsys.readouterr()
    [pub] = published
    assert pub.status == "published" and not pub.layers["vllm"]  # it skipped the layer rm deleted
    assert doomed not in blobs_in(store)
    assert code == 1
    assert json.loads(said.out)["raced"] == [{"recipe": "tiny", "key": art_c.key, "blob": doomed}]
    assert f"damaged: tiny {art_c.key[:16]} was published while rm ran and names blob {doomed[:16]}" in said.err
    assert "publish that artifact file again" in said.err
    monkeypatch.undo()
    assert build.publish(store, third).status == "mended" and doomed in blobs_in(store)


def test_publish_says_what_went_up_and_fails_on_an_entry_it_cannot_mend(packed, tmp_path):
    """The text of a layered publish named the whole file's blob (never uploaded, not in the store)
    and hid the layers; another build of a key whose entry lost a blob said already-published, exit
    0, and every node on the key went on missing. It fails, naming the blob and the fix, which works."""
    from warmer.cli.build import publish_line

    a, b = packed("a"), packed("b", extra={"inductor/other.bin": b"another build"})
    assert a.artifact.key == b.artifact.key
    store = open_store(f"file://{tmp_path / 'store'}")
    first = run_warmer("publish", a.path, "--store", store.url, "--layers")
    assert first.returncode == 0 and "layers: " in first.stdout and "vllm uploaded" in first.stdout, first.stdout
    done = build.publish(open_store(f"file://{tmp_path / 'other'}"), a.path, layers=True)
    assert publish_line(done).startswith(f"publish: published to file://{tmp_path / 'other'} (3 of 3 layer(s) uploaded")

    lost = layer(a.artifact, "inductor").sha256  # b holds other inductor bytes: it cannot mend that one
    store.delete_blob(lost)
    url = f"{store.url}/index/tiny/{a.artifact.key}"
    refused = run_warmer("publish", b.path, "--store", store.url)
    assert refused.returncode == 1, refused.stderr
    assert f"names 1 blob(s) the store lacks and this file does not hold ({lost[:12]})" in refused.stderr
    assert f"`warmer rm {url} --yes` and publish this one" in refused.stderr
    assert run_warmer("rm", url, "--yes").returncode == 0
    assert run_warmer("publish", b.path, "--store", store.url).returncode == 0
    assert fetch.fetch(tiny_recipe(), store, tmp_path / "root").hit


def test_rm_that_stops_partway_records_what_it_deleted_not_what_it_meant_to(two, monkeypatch):
    """The audit record was written before the deletes, listing every blob as deleted: a store that
    refused one (a read-only directory, a missing s3:DeleteObject) left a record of a removal that
    did not happen. The refusal is stood in for by the file store's delete raising as the OS does."""
    from warmer.store.file import FileStore

    store, art_a, art_b, _, _, _ = two
    doomed = layer(art_b, "vllm").sha256
    monkeypatch.setattr(FileStore, "delete_blob", lambda self, sha: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", f"{sha}.tar.zst")))
    with pytest.raises(StoreError, match=r"removed .* and 0 of its 1 blob\(s\) to delete, then stopped "
                                         r"\(Permission denied\)"):
        catalog.rm(f"{store.url}/index/tiny/{art_b.key}", yes=True)
    [record] = [json.loads(p.read_text()) for p in (store.base / "audit").iterdir()]
    assert record["blobs_deleted"] == [] and "Permission denied" in record["error"]
    assert doomed in blobs_in(store) and ("tiny", art_b.key) not in store.list_index()

    # the record itself refused, after the deletes: rm says what it removed, not only the record's error
    monkeypatch.undo()
    monkeypatch.setattr(FileStore, "write_audit", lambda self, name, record: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", name)))
    with pytest.raises(StoreError, match=r"removed .* and 3 of its 3 blob\(s\) to delete, but the audit record "
                                         r"could not be written \(Permission denied\)"):
        catalog.rm(f"{store.url}/index/tiny/{art_a.key}", yes=True)


def test_gc_that_stops_partway_says_how_far_it_got(two, monkeypatch):
    """A blob delete refused (stood in for by the file store's delete raising as the OS does) was a
    bare `Permission denied`, the entries already deleted unsaid."""
    from warmer.store.file import FileStore

    store, *_ = two
    monkeypatch.setattr(FileStore, "delete_blob", lambda self, sha: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", f"{sha}.tar.zst")))
    with pytest.raises(StoreError, match=r"gc stopped \(Permission denied\): its 1 index entries are deleted; "
                                         r"0 of 1 blobs deleted; fix that and run gc again"):
        catalog.gc(store, 1)


def test_rm_keeps_the_layers_another_entry_names(two):
    store, art_a, art_b, _, _, path_b = two
    url = f"{store.url}/index/tiny/{art_b.key}"
    dry = cli("rm", url)
    assert dry["dry_run"] and dry["would_delete_blobs"] == [layer(art_b, "vllm").sha256]
    assert {x["component"]: x["would_delete"] for x in dry["layers"]} == {c: c == "vllm" for c in art_b.components}
    assert len(store.list_index()) == 2  # nothing removed

    out = run_warmer("rm", url, "--yes", "--json")
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["deleted_blobs"] == [layer(art_b, "vllm").sha256] and done["blob"] is None
    assert "vllm " + layer(art_b, "vllm").sha256[:12] + " deleted" in out.stderr
    assert "inductor " + layer(art_b, "inductor").sha256[:12] + " kept" in out.stderr
    assert store.list_index() == [("tiny", art_a.key)]
    assert blobs_in(store) == {x.sha256 for x in art_a.layers}  # the shared layers stay
    [audit] = (store.base / "audit").glob("*-rm-tiny-*.json")  # who removed what, and which blobs went
    record = json.loads(audit.read_text())
    assert record["blobs_deleted"] == [layer(art_b, "vllm").sha256] and record["blob"] is None
    assert record["blobs"] == [x.sha256 for x in art_b.layers]
    listed = cli("ls", "--store", store.url)
    assert not [d for d in listed if "orphan_blob" in d]
    assert listed[-1]["stored_bytes"] == listed[-1]["unshared_bytes"] == sum(x.size for x in art_a.layers)

    # Removed again while the other entry is unreadable: rm cannot know what that one names, so it
    # keeps every layer; the unshared one is then an orphan that ls shows and gc removes.
    assert build.publish(store, path_b, layers=True).layers == {c: c == "vllm" for c in art_b.components}
    store.put_index("broken", "f" * 64, b"{not json")
    kept = cli("rm", url, "--yes")
    assert kept["deleted_blobs"] == [] and layer(art_b, "vllm").sha256 in blobs_in(store)
    cli("rm", f"{store.url}/index/broken/{'f' * 64}", "--yes")
    listed = cli("ls", "--store", store.url)
    assert [d["orphan_blob"] for d in listed if "orphan_blob" in d] == [layer(art_b, "vllm").sha256]
    young = cli("gc", "--store", store.url, "--keep", "1")
    assert young["deleted_blobs"] == [] and [b["orphan_blob"] for b in young["orphans_kept"]] == \
        [layer(art_b, "vllm").sha256]
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(minutes=5)
    assert catalog.gc(store, 1, now=later).deleted_blobs == (layer(art_b, "vllm").sha256,)
    assert blobs_in(store) == {x.sha256 for x in art_a.layers}


def test_publishing_again_mends_a_layered_entry_whose_layer_a_gc_race_deleted(two, tmp_path):
    """A layered publish skips the layers the store holds; a gc that drops the entry naming them can
    delete one after that publish looked (the race has no lock to close it). Publishing the file
    again uploads that layer alone, and the entry is whole again."""
    store, _, art_b, _, _, path_b = two
    gone = layer(art_b, "inductor")
    store.delete_blob(gone.sha256)
    got = api.fetch(tiny_recipe(max_model_len=256), store.url, tmp_path / "node-a")
    assert got.status == "error", got.warnings
    mended = build.publish(store, path_b)  # with or without --layers: the file holds every layer
    assert mended.status == "mended" and mended.mended == (gone.sha256,) and mended.bytes_uploaded == gone.size
    assert not mended.blob_uploaded and mended.missing_blobs is None
    assert api.fetch(tiny_recipe(max_model_len=256), store.url, tmp_path / "node-b").status == "hit"
