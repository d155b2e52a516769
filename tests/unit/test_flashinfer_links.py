"""FlashInfer's trtllm-gen modules include their export headers through links it makes in its workspace
(flashinfer/jit/fused_moe.py, moe_utils.py, gemm/core.py: ensure_symlink(generated/.../trtllmGen_*_export ->
FLASHINFER_CUBIN_DIR/...)), and ninja's deps name the headers by the linked path. An artifact holds no
links, so the contract records them and a restore makes them again: warmer's ninja dry run and verify's
snapshot then see the workspace as FlashInfer leaves it. A real ninja module in FlashInfer's layout, gcc
standing in for nvcc (no GPU, no CUDA needed); real pack, real file store, real restore."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_cache_tree
from tests.unit.test_shared_workspace import MODULE_DIR, _module, _pack, recipe
from warmer import build, fetch, restore, verify, warmup, workspace
from warmer.components import flashinfer
from warmer.fingerprint import package_dir
from warmer.store import open_store
from warmer.untrusted import Fields, InvalidDocument

pytestmark = pytest.mark.skipif(package_dir("flashinfer") is None, reason="flashinfer-python is not installed")
MODULE = "fused_moe_trtllm_sm100"
EXPORT = "abc123/batched_gemm-deadbeef/include/trtllmGen_bmm_export"  # under the cubin dir
LINK = f"generated/trtllm_export/{MODULE}/flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export"  # under <ver>/<arch>
SERVED = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # the venv's ninja


def _warm(ws: Path) -> None:
    """What FlashInfer's warm-up leaves in the workspace ws (FLASHINFER_WORKSPACE_BASE): the export
    header in the cubin dir, the link to it made as ensure_symlink makes it (absolute), and the module
    built by ninja with deps = gcc, its header named through the link."""
    cache = Path(os.path.realpath(ws)) / flashinfer.CACHE
    header = cache / "cubins" / EXPORT / "KernelParams.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define TILE 128\n")
    arch = cache / MODULE_DIR.split(f"{flashinfer.CACHE}/")[1]
    (arch / LINK).parent.mkdir(parents=True)
    (arch / LINK).symlink_to(header.parent)
    gen, mod = arch / "generated", arch / "cached_ops" / MODULE
    (gen / f"{MODULE}.c").write_text(
        '#include "flashinfer/trtllm/batched_gemm/trtllmGen_bmm_export/KernelParams.h"\nint tile(void){return TILE;}\n'
    )
    mod.mkdir(parents=True)
    (mod / "build.ninja").write_text(
        "rule cc\n"
        f"  command = gcc -MD -MF $out.d -I{gen}/trtllm_export/{MODULE} -c $in -o $out\n"
        "  depfile = $out.d\n"
        "  deps = gcc\n"
        f"build {mod}/{MODULE}.o: cc {gen}/{MODULE}.c\n"
    )
    subprocess.run(["ninja", "-C", str(mod)], check=True, capture_output=True, env=SERVED)


def _as_flashinfer_starts(root: Path, env: dict[str, str]) -> None:
    """What FlashInfer does before it runs ninja (cubin_loader.ensure_symlink): it keeps a link that
    resolves to its target, and makes one where there is none."""
    link = root / MODULE_DIR / LINK
    target = Path(env["FLASHINFER_CUBIN_DIR"]) / EXPORT
    if not (link.is_symlink() and link.resolve() == target.resolve()):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(target)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-workspace", "in-root"])
def test_a_restored_trtllm_module_is_clean_and_its_start_adds_no_files(tmp_path, shared):
    base, store = tmp_path / "cache", open_store(f"file://{tmp_path / 'store'}")
    root = base / "a"
    make_cache_tree(root)
    saved = dict(os.environ)
    os.environ.update(SERVED)  # pack records the FlashInfer contract in the build's env
    try:
        if shared:
            workspace.link(root, flashinfer.contract(root, dict(os.environ)))
        _warm(root / "flashinfer")
        assert flashinfer.dry_run(root, SERVED)["clean"] is True
        art = build.pack_root(root, recipe("a"), tmp_path / "a.tar.zst")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    fi = art.path_contract.flashinfer
    assert fi.links == {f"{MODULE_DIR.split(f'{flashinfer.CACHE}/')[1]}/{LINK}": EXPORT}  # both relative
    assert not any("trtllmGen_bmm_export" in e.path and "generated" in e.path for e in art.files)  # no links packed
    build.publish(store, tmp_path / "a.tar.zst", layers=True)
    shutil.rmtree(base)  # the node starts from nothing

    got = fetch.fetch(recipe("a"), store, root, serving_env=SERVED)
    assert got.status == "hit", got.warnings
    assert (root / "flashinfer").is_symlink() == shared
    assert got.flashinfer["clean"] is True, got.flashinfer  # was: the linked header "doesn't exist"
    assert not [w for w in got.warnings if "ninja would rebuild" in w]
    link = root / MODULE_DIR / LINK
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    # verify's snapshot before and after FlashInfer's start: it keeps the link, no file appears through it.
    before = verify.snapshot(root)
    assert not [p for p in before if f"{LINK}/" in p]  # the header is listed once, in the cubin dir
    _as_flashinfer_starts(root, got.env.vars)
    assert verify.delta(before, verify.snapshot(root)).recompiled == 0
    assert flashinfer.dry_run(root, SERVED, fi)["clean"] is True
    assert fetch.fetch(recipe("a"), store, root, serving_env=SERVED).restore.status == "already-active"

    # A second root of the node: the shared workspace's units are taken as they are (the FlashInfer layer
    # is not downloaded) and a link someone removed is made again.
    if shared:
        link.unlink()
        again = fetch.fetch(recipe("a"), store, base / "a2", serving_env=SERVED)
        assert again.status == "hit" and "flashinfer" in again.restore.reused
        assert again.flashinfer["clean"] is True and link.is_symlink()


def test_links_outside_the_cubin_dir_are_not_recorded(tmp_path):
    cache = tmp_path / "flashinfer" / flashinfer.CACHE
    (cache / "cubins" / "x").mkdir(parents=True)
    (cache / "0.7/90a/generated").mkdir(parents=True)
    (cache / "0.7/90a/generated/in").symlink_to(cache / "cubins" / "x")
    (cache / "0.7/90a/generated/out").symlink_to(tmp_path)
    (cache / "0.7/90a/generated/up").symlink_to("../../../cubins/../..")
    assert flashinfer.links(tmp_path) == {"0.7/90a/generated/in": "x"}


@pytest.mark.parametrize(
    "links",
    [
        {"../../x": "a"},
        {"/etc/x": "a"},
        {"a": "/etc"},
        {"a": "../../.."},
        {"a": "."},
        {"a": "b", "a/c": "d"},
        # loops, which verify's snapshot (os.walk, links followed) would walk 2**40 times: a link to its own
        # directory, to itself, and two that lead to each other
        {"cubins/d/l1": "d", "cubins/d/l2": "d"},
        {"cubins/d": "d"},
        {"cubins/x/a": "y", "cubins/y/b": "x"},
    ],
)
def test_an_artifacts_links_that_could_leave_the_workspace_are_refused(links):
    doc = {**flashinfer.FlashInferContract("/w", None, None, None, None, None, None, None, {}).to_json()}
    assert flashinfer.FlashInferContract.from_json(Fields({**doc, "links": {"x/y": "a/b"}}, "fi")).links
    assert flashinfer.FlashInferContract.from_json(Fields({k: v for k, v in doc.items() if k != "links"}, "fi")).links == {}
    with pytest.raises(InvalidDocument, match="links"):
        flashinfer.FlashInferContract.from_json(Fields({**doc, "links": links}, "fi"))


def test_two_recipes_trtllm_headers_are_units_of_their_own_modules(tmp_path):
    """generated/trtllm_export/<m>/ belongs to module m: b's restore neither removes a's headers nor
    takes the unit from a, and both roots stay intact (was: one unit for every module, the roots took
    it from each other on every fetch and a's header was gone)."""
    base, store = tmp_path / "cache", open_store(f"file://{tmp_path / 'store'}")
    mods = {"a": "fused_moe_trtllm_sm100", "b": "trtllm_gemm_sm100"}
    for name, mod in mods.items():
        header = {f"{MODULE_DIR}/generated/trtllm_export/{mod}/flashinferMetaInfo.h": f"// {mod}\n".encode()}
        make_cache_tree(base / name)
        _pack(base / name, name, {**_module(mod, os.urandom(1000)), **header}, tmp_path / f"{name}.tar.zst")
        build.publish(store, tmp_path / f"{name}.tar.zst", layers=True)
        shutil.rmtree(base)
    for name in ("a", "b"):
        assert fetch.fetch(recipe(name), store, base / name).status == "hit"
    assert (base / "a" / MODULE_DIR / f"generated/trtllm_export/{mods['a']}/flashinferMetaInfo.h").exists()
    for name in ("a", "b"):
        assert fetch.fetch(recipe(name), store, base / name).restore.status == "already-active"
    assert restore.still_intact(restore.active(base / "a"), base / "a") is None


def _swapped_for_a_link(d: Path, outside: Path, symlink=os.symlink) -> Path:
    """What a pod of the node (the shared workspace is writable by every pod) does between a restore's
    check of d and its use: d moved aside, a link to outside in its place. Returns where d went."""
    aside = d.with_name(d.name + ".aside")
    if not d.is_symlink():
        d.rename(aside)
        symlink(outside, d)
    return aside


def test_a_link_is_never_made_outside_the_workspace_through_a_directory_a_pod_swaps_after_the_check(
    tmp_path, monkeypatch
):
    """make_links runs as root in W; a pod that swaps the link's directory for a link to /etc (say) after
    it was checked, before the link is made, gets nothing made there (was: the link made in the pod's
    directory, with the artifact's name; a real race, renameat2 in a loop, won in 1 s)."""
    top = tmp_path / workspace.SHARED / "0123456789abcdef"
    cache = top / workspace.WS / flashinfer.CACHE
    rel = f"{MODULE_DIR.split(f'{flashinfer.CACHE}/')[1]}/{LINK}"
    (cache / rel).parent.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    symlink = os.symlink

    def pod_then_symlink(*args, **kwargs):
        _swapped_for_a_link((cache / rel).parent, outside, symlink)
        return symlink(*args, **kwargs)

    monkeypatch.setattr(os, "symlink", pod_then_symlink)
    fi = flashinfer.FlashInferContract("/w", None, None, None, None, None, None, None, {}, links={rel: EXPORT})
    workspace.make_links(top / workspace.WS, fi, top.parent)
    assert list(outside.iterdir()) == []
    assert (_swapped_for_a_link((cache / rel).parent, outside) / Path(rel).name).is_symlink()  # made where checked


def test_a_module_is_never_removed_outside_the_workspace_through_a_directory_a_pod_swaps_after_the_check(
    tmp_path, monkeypatch
):
    """_clear (as root, before a unit moves in) removes a module's generated/trtllm_export/<m>/; a pod that
    swaps generated/trtllm_export for a link after its check gets nothing outside removed (was: <outside>/<m>
    removed; a real race, renameat2 in a loop, won 63 times in 10 s)."""
    ws = workspace.Workspace(tmp_path / workspace.SHARED / "0123456789abcdef")
    arch = ws.path / MODULE_DIR[len(workspace.PREFIX) :]
    export = arch / "generated" / workspace.TRTLLM_EXPORT
    (export / MODULE).mkdir(parents=True)
    (export / MODULE / "h").write_text("x")
    outside = tmp_path / "outside"
    (outside / MODULE).mkdir(parents=True)
    (outside / MODULE / "precious").write_text("x")
    rmtree = shutil.rmtree

    def pod_then_rmtree(*args, **kwargs):
        _swapped_for_a_link(export, outside)
        return rmtree(*args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", pod_then_rmtree)
    ws._clear(f"{MODULE_DIR}/cached_ops/{MODULE}")
    assert (outside / MODULE / "precious").exists()
    assert not (_swapped_for_a_link(export, outside) / MODULE).exists()  # removed where checked


def test_verify_follows_the_roots_link_to_the_shared_workspace_and_no_link_in_it(tmp_path):
    """The shared workspace is writable by every pod of the node; a link loop planted there (l1, l2, l3 -> .)
    made verify's snapshot, and the census after each engine run, walk 3**40 paths: never ending. They follow
    the root's flashinfer/ only (was, with one such link: the file listed 40 times, until ELOOP)."""
    root = tmp_path / "cache" / "a"
    top = tmp_path / "cache" / workspace.SHARED / "0123456789abcdef"
    ops = top / workspace.WS / MODULE_DIR[len(workspace.PREFIX) :] / "cached_ops"
    (ops / "m").mkdir(parents=True)
    (ops / "m" / "m.so").write_bytes(b"x")
    (ops / "loop").symlink_to(".")
    root.mkdir()
    (root / flashinfer.SUBDIR).symlink_to(workspace.target(top.name))
    assert list(verify.snapshot(root)) == [f"{MODULE_DIR}/cached_ops/m/m.so"]
    assert warmup._files(root) == [(f"{MODULE_DIR}/cached_ops/m/m.so", 1)]
