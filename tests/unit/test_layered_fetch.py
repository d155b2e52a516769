"""Layered artifacts on the node: each cache component is a zstd frame of the archive and, published
with --layers, a blob of its own. A fetch reads only the layers it activates, and takes a layer that
another root of the node already holds from there (checked file by file), downloading nothing for it.
Real pack, real file store, real restore; the GPUs of the partial hit come from recorded fixtures."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, make_cache_tree, tiny_recipe, write_tiny_recipe
from tests.fixtures import nodes
from tests.unit.test_blob_stream import Store, stream
from warmer import archive, build, components, fetch, fingerprint, restore
from warmer.entry import IndexEntry
from warmer.store import open_store

SHARED = {
    "triton/AB3C/triton_poi_fused_0.cubin": os.urandom(40_000),
    "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/silu_and_mul/silu_and_mul.so": os.urandom(60_000),
}


def _pack(tmp_path, name="a", gpus=None, at=None):
    src = at or tmp_path / f"src-{name}"
    files = make_cache_tree(src)
    for rel, data in SHARED.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    fp = fingerprint.probe(root=src, model="/models/tiny")
    if gpus:
        fp = fp.with_gpus(nodes.gpu_node(gpus).gpu)
    out = tmp_path / f"{name}.tar.zst"
    art = build.pack_root(src, tiny_recipe(), out, fp=fp)
    if at:
        shutil.rmtree(at)  # a fresh node: the root is where the build was
    return out, art, {**files, **SHARED}


def test_pack_writes_a_frame_per_component_and_the_archive_stays_one_tar(tmp_path):
    out, art, files = _pack(tmp_path)
    assert [layer.component for layer in art.layers] == list(art.components)
    with open(out, "rb") as f:
        body = archive.first_frame_size(f)
        for layer in art.layers:  # each layer is its own frame, at its offset, of its digest
            f.seek(body + layer.offset)
            assert hashlib.sha256(f.read(layer.size)).hexdigest() == layer.sha256
    assert art.layers[-1].offset + art.layers[-1].size + body + len(archive.END_FRAME) == out.stat().st_size
    listed = subprocess.run(["tar", "--zstd", "-tf", out], capture_output=True, text=True, check=True).stdout
    assert set(files) <= set(listed.split())


def test_a_layered_publish_fetches_layer_by_layer_and_a_second_root_takes_them_from_the_node(tmp_path):
    out, art, files = _pack(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    published = build.publish(store, out, layers=True)
    assert published.status == "published" and all(published.layers.values())
    assert published.bytes_uploaded == sum(layer.size for layer in art.layers)
    entry = IndexEntry.read(store.get_index("tiny", art.key), "tiny", art.key)
    assert entry.layered and {b.sha256 for b in entry.blobs} == {layer.sha256 for layer in art.layers}

    base = tmp_path / "cache"
    first = fetch.fetch(tiny_recipe(), store, base / "one")
    assert first.status == "hit", first.warnings
    assert first.restore.archive_bytes == sum(layer.size for layer in art.layers) and not first.restore.reused
    for rel, data in files.items():
        assert (base / "one" / rel).read_bytes() == data

    second = fetch.fetch(tiny_recipe(), store, base / "two")  # another root of the same node
    assert second.status == "hit" and second.restore.archive_bytes == 0
    assert set(second.restore.reused) == set(art.components)
    for rel, data in files.items():
        path = base / "two" / rel
        assert path.read_bytes() == data and not os.path.samefile(path, base / "one" / rel)
    entry_of = {e.path: e for e in art.files}
    rel = next(iter(SHARED))
    assert (base / "two" / rel).stat().st_mtime_ns == entry_of[rel].mtime_ns  # ninja compares mtimes
    assert fetch.fetch(tiny_recipe(), store, base / "two").restore.status == "already-active"



@pytest.fixture
def one_root(tmp_path):
    """A layered artifact published, and fetched into BASE/one: (store, artifact, files, BASE, a
    shared layer's file in BASE/one, that layer's component)."""
    out, art, files = _pack(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, out, layers=True)
    base = tmp_path / "cache"
    assert fetch.fetch(tiny_recipe(), store, base / "one").status == "hit"
    rel = next(iter(SHARED))
    return store, art, files, base, rel, "triton" if rel.startswith("triton/") else "flashinfer"


def test_a_tampered_sibling_is_not_copied_and_the_layer_is_downloaded(one_root):
    store, art, files, base, rel, tampered = one_root
    victim = base / "one" / rel
    victim.write_bytes(b"\x7fELF not what was built" + bytes(len(files[rel]) - 23))  # same size, other bytes

    got = fetch.fetch(tiny_recipe(), store, base / "two")
    assert got.status == "hit"
    assert tampered not in got.restore.reused and got.restore.archive_bytes == art.layer(tampered).size
    assert (base / "two" / rel).read_bytes() == files[rel]


def test_a_partial_hit_downloads_only_the_layers_that_fit(tmp_path):
    out, art, _ = _pack(tmp_path, "sxm", gpus="h100-sxm", at=tmp_path / "pcie")
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, out, layers=True)
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "pcie", gpus=nodes.gpu_node("h100-pcie").gpu)
    assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components)
    assert got.restore.archive_bytes == sum(art.layer(c).size for c in got.components)
    assert got.restore.archive_bytes < sum(layer.size for layer in art.layers)
    assert not (tmp_path / "pcie" / "inductor" / "fxgraph").exists()


def test_a_corrupt_layer_is_never_activated(tmp_path):
    out, art, _ = _pack(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, out, layers=True)
    layer = art.layer("inductor")
    blob = tmp_path / "store" / "blobs" / "sha256" / layer.sha256[:2] / f"{layer.sha256}.tar.zst"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "node")
    assert got.status == "error" and not got.hit
    assert restore.active(tmp_path / "node") is None


def test_publishing_an_artifact_packed_before_layers_in_layers_is_refused(tmp_path):
    out, art, _ = _pack(tmp_path)
    doc = art.to_json()
    del doc["layers"]
    archive.replace_manifest(out, build.Artifact.from_json(doc).canonical)
    with pytest.raises(build.BuildError, match="packed before layers"):
        build.publish(open_store(f"file://{tmp_path / 'store'}"), out, layers=True)
    assert build.publish(open_store(f"file://{tmp_path / 'store'}"), out).status == "published"


def test_the_size_cap_holds_for_the_layers_together(tmp_path):
    out, art, _ = _pack(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, out, layers=True)
    cap = art.total_bytes - 1
    assert all(c.bytes < cap for c in art.components.values())  # no layer alone is over it
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "node", max_bytes=cap)
    assert got.status == "error" and any("over the limit" in w for w in got.warnings), got.warnings
    assert restore.active(tmp_path / "node") is None


def test_a_fifo_in_a_sibling_root_is_not_waited_on(one_root):
    store, art, files, base, rel, component = one_root
    (base / "one" / rel).unlink()
    os.mkfifo(base / "one" / rel)  # opened for reading, a FIFO would block the copy forever

    got = fetch.fetch(tiny_recipe(), store, base / "two")
    assert got.status == "hit" and (base / "two" / rel).read_bytes() == files[rel]
    assert component not in got.restore.reused and got.restore.archive_bytes >= art.layer(component).size


def _blob(tmp_path, layer):
    return tmp_path / "store" / "blobs" / "sha256" / layer.sha256[:2] / f"{layer.sha256}.tar.zst"


def _over_the_wire(tmp_path, opened, damaged=None):
    """open_layer as an S3 or OCI store gives it (3 reads of a blob allowed), over the file store's
    bytes: the first read of the layer `damaged` has one byte flipped on the way."""
    def open_layer(layer):
        data = bytearray(_blob(tmp_path, layer).read_bytes())
        opened.append(layer.component)
        if layer.component == damaged and opened.count(damaged) == 1:
            data[len(data) // 2] ^= 0xFF
        return stream(Store(bytes(data)), sha=layer.sha256, size=len(data))
    return open_layer


def test_a_layer_damaged_on_the_way_is_read_again_and_the_layers_before_it_stay(tmp_path):
    """Every layer unpacks into one staging directory: reading one layer again must not cost the
    others (they were lost, and the root activated without them, as a hit)."""
    out, art, files = _pack(tmp_path)
    build.publish(open_store(f"file://{tmp_path / 'store'}"), out, layers=True)
    last, opened = art.layers[-1].component, []
    root = tmp_path / "cache" / "tiny"

    got = restore.restore(art, None, root, open_layer=_over_the_wire(tmp_path, opened, damaged=last))
    assert got.status == "restored" and opened.count(last) == 2 and len(opened) == len(art.layers) + 1
    for rel, data in files.items():
        assert (root / rel).read_bytes() == data, rel
    assert restore.still_intact(restore.active(root), root) is None


def test_a_staging_tree_that_lost_a_file_is_never_activated(tmp_path):
    """The last check before the swap: staging must hold every file the marker lists. Staging sits in
    the root base, which every pod of the node can write: here a file of the first layer goes while
    the last one downloads."""
    out, art, files = _pack(tmp_path)
    build.publish(open_store(f"file://{tmp_path / 'store'}"), out, layers=True)
    root, opened = tmp_path / "cache" / "tiny", []
    first = next(e.path for e in art.files if components.of_path(e.path).name == art.layers[0].component)
    open_layer = _over_the_wire(tmp_path, opened)

    def losing(layer):
        if layer == art.layers[-1]:
            [staging] = root.parent.glob(".tiny.staging-*")
            (staging / first).unlink()
        return open_layer(layer)

    with pytest.raises(restore.RestoreError, match=f"staging directory is incomplete: {first} is missing"):
        restore.restore(art, None, root, open_layer=losing)
    assert restore.active(root) is None and not list(root.parent.glob(".tiny.staging-*"))


def test_a_copy_from_a_sibling_that_fails_leaves_nothing_in_the_way_of_the_download(one_root):
    """A sibling's file is copied and the write fails (a real limit: RLIMIT_FSIZE, EFBIG, as a full
    disk fails it): the half-written copy is removed, so the layer's download writes that path, and a
    failure is its own (here the same limit), not 'File exists' from the copy's leftover."""
    store, art, files, base, rel, component = one_root
    limit = max(len(data) for data in files.values()) - 1  # the largest file cannot be written
    script = ("import resource, signal, sys; from pathlib import Path\n"
              "from tests.conftest import tiny_recipe; from warmer import fetch; from warmer.store import open_store\n"
              "store = open_store(sys.argv[1])\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
              "got = fetch.fetch(tiny_recipe(), store, Path(sys.argv[2]))\n"
              "print(got.status, *got.warnings, sep='\\n')\n")
    out = subprocess.run([sys.executable, "-c", script, store.url, str(base / "two")], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("error\n") and "File too large" in out.stdout, out.stdout
    assert "File exists" not in out.stdout
    assert restore.active(base / "two") is None and not list(base.glob(".two.staging-*"))


NEWER_COMPONENT = '''from warmer.components.base import Component
COMPONENT = Component(name="deepep", subdir="deepep", env=(("DEEPEP_CACHE_DIR", "deepep"),),
                      about="a cache a newer warmer packs", relocatable=False,
                      defaults=(("DEEPEP_CACHE_DIR", "{xdg}/deepep"),))
ORDER = 95
COMPONENTS = (COMPONENT,)
'''


def test_a_layer_of_a_cache_only_a_newer_warmer_packs_is_left_out_and_the_rest_restored(tmp_path):
    """A newer warmer packs one more cache, as a layer of its own: this warmer restored every layer,
    found that one's files listed under no component it knows, and refused the whole artifact
    ("not listed in artifact.json"), so every node not yet upgraded started cold. It is left out,
    said so, and the layers this warmer knows are a partial hit. Packed by this checkout's warmer
    with that one cache module added, in a process of its own."""
    newer = tmp_path / "newer"
    shutil.copytree(REPO / "warmer", newer / "warmer", ignore=shutil.ignore_patterns("__pycache__"))
    (newer / "warmer" / "components" / "deepep.py").write_text(NEWER_COMPONENT)
    src = tmp_path / "src"
    files = make_cache_tree(src)
    (src / "deepep" / "kernels").mkdir(parents=True)
    (src / "deepep" / "kernels" / "k.bin").write_bytes(os.urandom(5000))
    store_url = f"file://{tmp_path / 'store'}"
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    script = ("import sys; from pathlib import Path; from warmer import build, recipe; from warmer.store import "
              "open_store\nsrc, url, rf, out = sys.argv[1:]\n"
              "art = build.pack_root(Path(src), recipe.load(Path(rf)), Path(out))\n"
              "assert 'deepep' in [x.component for x in art.layers], art.layers\n"
              "print(build.publish(open_store(url), Path(out), layers=True).status)\n")
    out = subprocess.run([sys.executable, "-c", script, str(src), store_url, str(recipe_file),
                          str(tmp_path / "a.tar.zst")], cwd=newer, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(newer)})
    assert out.returncode == 0 and out.stdout.strip() == "published", out.stderr

    root = tmp_path / "node"
    got = fetch.fetch(tiny_recipe(), store_url, root)
    assert got.status == restore.PARTIAL, got.warnings
    assert any("deepep: NO, a cache this warmer does not know" in w for w in got.warnings), got.warnings
    for rel, data in files.items():
        assert (root / rel).read_bytes() == data
    assert not (root / "deepep").exists()
    from warmer import api
    [c] = api.explain(tiny_recipe(), store_url).candidates  # what a pre-flight check reads agrees
    assert not c.accepted and set(c.partial) == set(got.components) and "deepep" not in c.partial
    again = fetch.fetch(tiny_recipe(), store_url, root)  # a no-op: nothing read again
    assert again.status in (*restore.ACTIVE, restore.PARTIAL) and again.restore.status == "already-active", \
        again.warnings
