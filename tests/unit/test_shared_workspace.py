"""The node's shared FlashInfer workspace (warmer/workspace.py): recipes whose roots sit side by side
build and serve FlashInfer in one workspace per key, so a second recipe takes the JIT modules the
first one restored, downloading nothing for them. Real pack, real file store, real restore; the
first test builds its module for real with nvcc (sm_90a), the others use module-shaped files."""

import json
import os
import shutil
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from tests.conftest import _tiny_doc, make_cache_tree, run_python
from tests.fixtures import counted_nvcc
from warmer import archive, build, components, fetch, restore, workspace
from warmer.components import flashinfer
from warmer.fingerprint import package_dir
from warmer.recipe import parse
from warmer.store import open_store

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
HAS_FLASHINFER = package_dir("flashinfer") is not None
pytestmark = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer-python is not installed")
MODULE_DIR = "flashinfer/.cache/flashinfer/0.7.0.post1/90a"


def recipe(name):
    return parse({**_tiny_doc("/models/tiny", {}), "name": name}, Path(f"{name}.toml"))


def _pack(root, name, files, out, env=None):
    """What `warmer build` does around its warm-up: root's flashinfer/ linked to the shared
    workspace of this toolchain (as build.cold_flashinfer links it), files written (through the link), pack."""
    saved = dict(os.environ)
    os.environ.update(env or {})  # pack records the FlashInfer contract in the build's env
    try:
        workspace.link(root, flashinfer.contract(root, dict(os.environ)))
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return build.pack_root(root, recipe(name), out)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _module(name, so):
    return {
        f"{MODULE_DIR}/cached_ops/{name}/build.ninja": f"rule nvcc\n# {name}\n".encode(),
        f"{MODULE_DIR}/cached_ops/{name}/{name}.so": so,
        f"{MODULE_DIR}/generated/{name}.cu": f"// {name}\n".encode(),
    }


@pytest.fixture
def node(tmp_path):
    """Two recipes built on two builders at the same root base (each packs its own copy of the module
    silu_and_mul, other bytes) and published layered; the node's root base is that path again:
    (store, base, artifact of a, artifact of b, b's files)."""
    base = tmp_path / "cache"
    store = open_store(f"file://{tmp_path / 'store'}")
    arts, files = {}, {}
    for name, extra in (("a", {}), ("b", _module("gelu_and_mul", os.urandom(30_000)))):
        files[name] = {**_module("silu_and_mul", os.urandom(50_000)), **extra}
        make_cache_tree(base / name)
        arts[name] = _pack(base / name, name, files[name], tmp_path / f"{name}.tar.zst")
        build.publish(store, tmp_path / f"{name}.tar.zst", layers=True)
        shutil.rmtree(base)  # the next builder, and then the node, start from nothing
    return store, base, arts["a"], arts["b"], files["b"]


def test_a_build_packs_its_flashinfer_files_from_the_shared_workspace(node):
    _, base, a, _, _ = node
    fi = a.path_contract.flashinfer
    assert Path(fi.workspace_base).parent.parent == base.resolve() / workspace.SHARED
    assert fi.modules == ("silu_and_mul",)
    assert f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so" in a.files.by_path()


def test_a_second_recipe_takes_the_modules_the_first_restored_and_downloads_nothing_for_them(node):
    store, base, a, b, b_files = node
    first = fetch.fetch(recipe("a"), store, base / "a")
    assert first.status == "hit" and "flashinfer" not in (first.restore.reused or ()), first.warnings
    ws = Path(os.path.realpath(base / "a" / "flashinfer"))
    assert (base / "a" / "flashinfer").is_symlink() and ws.parent.parent == base.resolve() / workspace.SHARED

    # b's FlashInfer layer holds a module W lacks (gelu_and_mul): it is downloaded, and only what W lacks moves in.
    second = fetch.fetch(recipe("b"), store, base / "b")
    assert second.status == "hit" and "flashinfer" not in (second.restore.reused or ())
    so = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert (base / "b" / so).read_bytes() != b_files[so]  # a's build of it stayed: it was intact
    assert (base / "b" / so).read_bytes() == (base / "a" / so).read_bytes()
    assert second.env.vars["FLASHINFER_WORKSPACE_BASE"] == str(ws)

    # Both roots stay intact (a's files are W's own), and b again is a no-op.
    for name in ("a", "b"):
        assert fetch.fetch(recipe(name), store, base / name).restore.status == "already-active"

    # A third root of b on the node (fetch --all's case): the FlashInfer layer costs 0 bytes.
    third = fetch.fetch(recipe("b"), store, base / "b2")
    assert third.status == "hit" and "flashinfer" in third.restore.reused
    assert third.restore.archive_bytes == 0  # every other layer was on the node too


def test_a_roots_ninja_dry_run_judges_the_modules_of_its_artifact_not_the_other_recipes(node):
    """W holds both recipes' modules; a's fetch runs ninja in a's (silu_and_mul) only, and a module of
    its own missing from W is named, not passed over."""
    store, base, a, b, _ = node
    served = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # the venv's ninja
    for name in ("a", "b"):
        assert fetch.fetch(recipe(name), store, base / name, serving_env=served).status == "hit"
    again = fetch.fetch(recipe("a"), store, base / "a", serving_env=served)
    assert again.restore.status == "already-active"
    assert set(again.flashinfer["modules"]) == {"silu_and_mul"}  # b's gelu_and_mul is in W too
    assert set(flashinfer.dry_run(base / "b", served, b.path_contract.flashinfer)["modules"]) == {
        "silu_and_mul",
        "gelu_and_mul",
    }
    # `warmer flashinfer-check --root a` judges a's modules as the fetch does: b's (here one that a
    # pod left half-built) counted as a's, "rebuilds needed" and exit 4 whatever a's own were
    (base / "a" / MODULE_DIR / "cached_ops" / "gelu_and_mul" / "build.ninja").write_text("build broken: phony\n")
    check = subprocess.run([sys.executable, "-m", "warmer", "flashinfer-check", "--root", str(base / "a")],
                           capture_output=True, text=True, env=served, timeout=120)
    assert "ninja dry run: 1 module(s)" in check.stdout and "gelu_and_mul" not in check.stdout, check.stdout

    shutil.rmtree(base / "a" / MODULE_DIR / "cached_ops" / "silu_and_mul")
    result = flashinfer.dry_run(base / "a", served, a.path_contract.flashinfer)
    assert result["clean"] is False and "not in the workspace" in result["modules"]["silu_and_mul"]["reasons"][0]


def test_a_module_a_running_vllm_is_building_is_left_to_it_and_moved_in_by_the_next_fetch(node, caplog):
    """A pod of a builds gelu_and_mul now (FlashInfer holds its lock, the real filelock FlashInfer
    uses, while ninja writes there) when b's fetch would move b's copy in: the restore leaves that
    module to the build, says so, and activates b; the next fetch, the lock free, moves b's copy in."""
    from filelock import FileLock  # FlashInfer's own lock (flashinfer/jit/core.py)

    store, base, a, b, b_files = node
    assert fetch.fetch(recipe("a"), store, base / "a").status == "hit"
    ops = base / "a" / MODULE_DIR / "cached_ops"
    (ops / "gelu_and_mul").mkdir()
    (ops / "gelu_and_mul" / "build.ninja").write_text("ninja is writing this\n")
    (ops / "tmp").mkdir(exist_ok=True)
    with FileLock(ops / "tmp" / "gelu_and_mul.lock", thread_local=False):
        got = fetch.fetch(recipe("b"), store, base / "b")
        assert got.status == "hit", got.warnings
        assert (ops / "gelu_and_mul" / "build.ninja").read_text() == "ninja is writing this\n"  # not cut off
        assert not (ops / "gelu_and_mul" / "gelu_and_mul.so").exists()
    assert "left to that build" in caplog.text
    again = fetch.fetch(recipe("b"), store, base / "b")
    assert again.status == "hit" and again.restore.status == "restored"  # b's root lacked a unit of its own
    rel = f"{MODULE_DIR}/cached_ops/gelu_and_mul/gelu_and_mul.so"
    assert (base / "b" / rel).read_bytes() == b_files[rel]
    assert fetch.fetch(recipe("b"), store, base / "b").restore.status == "already-active"


def test_a_damaged_unit_is_replaced_from_the_artifact_not_reused(node):
    store, base, a, b, b_files = node
    assert fetch.fetch(recipe("a"), store, base / "a").status == "hit"
    so = base / "a" / f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    so.write_bytes(b"\x7fELF planted" + bytes(so.stat().st_size - 12))  # same size, other bytes

    got = fetch.fetch(recipe("b"), store, base / "b")
    assert got.status == "hit" and "flashinfer" not in (got.restore.reused or ())
    rel = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert (base / "b" / rel).read_bytes() == b_files[rel]
    # a's root now serves b's build of the module: one build of the key is as good as another.
    assert fetch.fetch(recipe("a"), store, base / "a").restore.status == "already-active"


def test_with_trusted_keys_a_module_passed_off_as_rebuilt_on_the_node_is_replaced(tmp_path):
    """A pod that writes the workspace overwrites a module's .so and appends a line to its
    .ninja_log: without keys that passes for ninja's own rebuild (kept, the test below). With
    --trusted-key nothing built on the node passes for a signed unit: the signed copy goes back."""
    from tests.unit.test_signing import _keypair

    private, public = _keypair(tmp_path, "k")
    base, store = tmp_path / "cache", open_store(f"file://{tmp_path / 'store'}")
    files = {}
    for name in ("a", "b"):
        files[name] = {**_module("silu_and_mul", os.urandom(50_000)),
                       f"{MODULE_DIR}/cached_ops/silu_and_mul/.ninja_log": f"# ninja log v5\n1\t2\t0\t{name}\n".encode()}
        make_cache_tree(base / name)
        _pack(base / name, name, files[name], tmp_path / f"{name}.tar.zst")
        build.publish(store, tmp_path / f"{name}.tar.zst", str(private), layers=True)
        shutil.rmtree(base)
    keys = [str(public)]
    assert fetch.fetch(recipe("a"), store, base / "a", trusted_keys=keys).status == "hit"
    md = base / "a" / f"{MODULE_DIR}/cached_ops/silu_and_mul"
    (md / "silu_and_mul.so").write_bytes(b"\x7fELF planted by another pod")
    with open(md / ".ninja_log", "ab") as log:
        log.write(b"3\t4\t0\tplanted\n")

    got = fetch.fetch(recipe("b"), store, base / "b", trusted_keys=keys)
    assert got.status == "hit" and "flashinfer" not in (got.restore.reused or ()), got.restore
    rel = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert (base / "b" / rel).read_bytes() == files["b"][rel]


def test_a_module_flashinfer_rebuilt_on_the_node_is_kept_not_restored_again(tmp_path):
    """A node image rebuilt with the same pins gives FlashInfer's headers new mtimes: ninja rebuilds
    the module at the first start. The next fetch must keep that build (the artifact's copy put
    back would be rebuilt at every start), not download the artifact again and swap it in."""
    ninja = shutil.which("ninja")
    if ninja is None:
        pytest.skip("ninja is not on PATH")
    base, store = tmp_path / "cache", open_store(f"file://{tmp_path / 'store'}")
    header = tmp_path / "site" / "act.cuh"  # a FlashInfer header the module depends on, as pip installed it
    header.parent.mkdir()
    header.write_text("// act\n")
    os.utime(header, (1e9, 1e9))
    root = base / "a"
    make_cache_tree(root)
    workspace.link(root, flashinfer.contract(root, dict(os.environ)))
    md, gen = root / MODULE_DIR / "cached_ops" / "silu_and_mul", root / MODULE_DIR / "generated"
    md.mkdir(parents=True)
    gen.mkdir(parents=True)
    (gen / "silu_and_mul.cu").write_text("// silu_and_mul\n")
    md, cu = Path(os.path.realpath(md)), os.path.realpath(gen / "silu_and_mul.cu")
    (md / "build.ninja").write_text(  # absolute paths, as FlashInfer writes them
        f"rule cc\n  command = cat $in > $out\nbuild {md}/silu_and_mul.so: cc {cu} {header}\n"
    )

    def start() -> bool:  # what FlashInfer's build_and_load runs at every load; True when it built
        return "no work to do" not in subprocess.run([ninja, "-C", str(md)], capture_output=True, text=True,
                                                     check=True).stdout

    assert start()
    build.pack_root(root, recipe("a"), tmp_path / "a.tar.zst")
    build.publish(store, tmp_path / "a.tar.zst", layers=True)
    shutil.rmtree(base)  # the node, at the same root base
    assert fetch.fetch(recipe("a"), store, root).status == "hit" and not start()
    # A module changed otherwise (ninja did not append to its log) is put back from the artifact.
    (md / "silu_and_mul.so").write_bytes(b"planted")
    assert fetch.fetch(recipe("a"), store, root).restore.status == "restored" and not start()
    os.utime(header)  # the node's image rebuilt with the same pins
    assert start()
    again = fetch.fetch(recipe("a"), store, root)
    assert again.restore.status == "already-active", (again.status, again.warnings)
    assert not start()


def test_an_origin_that_does_not_hash_to_its_name_makes_its_units_untrusted(node):
    store, base, a, b, b_files = node
    assert fetch.fetch(recipe("a"), store, base / "a").status == "hit"
    top = Path(os.path.realpath(base / "a" / "flashinfer")).parent
    origin = top / "origins" / f"{a.id}.json"
    origin.write_bytes(origin.read_bytes().replace(b'"a"', b'"x"', 1))

    shared = workspace.Workspace(top)
    assert shared.missing(a.files, hashed=False)  # a's units have no origin to be checked against
    # ... for any other artifact: b's restore does not take a's build of silu_and_mul, it moves its own in.
    got = fetch.fetch(recipe("b"), store, base / "b")
    rel = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert got.status == "hit" and (base / "b" / rel).read_bytes() == b_files[rel]
    assert not shared.missing(a.files, hashed=True) and not shared.missing(b.files, hashed=True)
    # a itself is checked against the artifact in hand (its marker's, the store's), not the copy.
    assert not shared.missing(a.files, hashed=True, known=a)


def test_a_build_warms_from_cold_on_a_builder_whose_workspace_holds_another_recipes_modules(tmp_path):
    """One builder builds a, then b at the same root base. b's warm-up finds the shared workspace empty
    (it compiles every module it needs: its cold time is cold), under the workspace's lock; b's
    artifact holds b's modules only, not a's; after b's pack the workspace holds a's again, and once b's
    verify has restored b over its root (as `warmer build` does), a's root is intact."""
    base = tmp_path / "cache"
    a_files = {**_module("silu_and_mul", os.urandom(20_000)), **_module("rmsnorm", os.urandom(5_000))}
    _pack(base / "a", "a", a_files, tmp_path / "a.tar.zst")
    restore.restore_file(tmp_path / "a.tar.zst", base / "a", force=True)  # a's build verifies over its root
    b_files = {**_module("silu_and_mul", os.urandom(20_000)), **_module("gelu_and_mul", os.urandom(10_000))}

    with build.cold_flashinfer(recipe("b"), base / "b", {}):
        ws = Path(os.path.realpath(base / "b" / "flashinfer"))
        assert ws == Path(os.path.realpath(base / "a" / "flashinfer"))  # one workspace for both
        assert list(ws.iterdir()) == []  # a's modules are not there to be reused, or packed
        with pytest.raises(restore.RestoreError, match="still held"):  # a restore waits for the pack
            with restore.locked(ws.parent, timeout=0):
                pass
        for rel, data in b_files.items():
            (base / "b" / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / "b" / rel).write_bytes(data)
        b = build.pack_root(base / "b", recipe("b"), tmp_path / "b.tar.zst")

    packed = {e.path for e in b.files if e.path.startswith(workspace.PREFIX)}
    assert packed == set(b_files) and b.path_contract.flashinfer.modules == ("gelu_and_mul", "silu_and_mul")
    rms = f"{MODULE_DIR}/cached_ops/rmsnorm/rmsnorm.so"
    assert (base / "a" / rms).read_bytes() == a_files[rms]  # merged back: only a built it
    so = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert (base / "a" / so).read_bytes() == b_files[so]  # both built it: b's build stays
    assert not list(ws.parent.glob(workspace.ASIDE + "*"))
    restore.restore_file(tmp_path / "b.tar.zst", base / "b", force=True)
    for name in ("a", "b"):
        assert restore.still_intact(restore.active(base / name), base / name) is None, name


def test_what_an_interrupted_build_set_aside_is_merged_back_by_the_next(tmp_path):
    base = tmp_path / "cache"
    files = _module("silu_and_mul", os.urandom(20_000))
    _pack(base / "a", "a", files, tmp_path / "a.tar.zst")
    ws = workspace.Workspace(Path(os.path.realpath(base / "a" / "flashinfer")).parent)
    assert ws.set_aside() is not None  # and the build is killed here: nothing merges it back
    assert list(ws.path.iterdir()) == []
    with build.cold_flashinfer(recipe("b"), base / "b", {}):
        assert list(ws.path.iterdir()) == []  # b's warm-up is cold too
        assert len(list(ws.top.glob(workspace.ASIDE + "*"))) == 1  # the leftover is in b's set-aside
    so = f"{MODULE_DIR}/cached_ops/silu_and_mul/silu_and_mul.so"
    assert (base / "a" / so).read_bytes() == files[so]
    assert not list(ws.top.glob(workspace.ASIDE + "*"))


def test_a_single_blob_artifact_goes_into_the_workspace_too(tmp_path):
    base = tmp_path / "cache"
    files = _module("silu_and_mul", os.urandom(20_000))
    out = tmp_path / "a.tar.zst"
    art = _pack(base / "a", "a", files, out)
    shutil.rmtree(base)
    root = restore.restore_file(out, base / "a")
    assert root.status == "restored" and (base / "a" / "flashinfer").is_symlink()
    ws = workspace.Workspace.of(art, base / "a")
    assert ws is not None and not ws.missing(art.files, hashed=True)
    assert restore.still_intact(restore.active(base / "a"), base / "a") is None
    # The link is part of the root: a root whose flashinfer/ is a directory again is not intact.
    (base / "a" / "flashinfer").unlink()
    (base / "a" / "flashinfer").mkdir()
    assert "is not the link" in restore.still_intact(restore.active(base / "a"), base / "a")


def test_an_artifact_built_in_its_root_restores_as_before(tmp_path):
    """Artifacts of an older warmer (the workspace inside the root) restore into the root itself."""
    src = tmp_path / "src" / "a"
    files = _module("silu_and_mul", os.urandom(20_000))
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    art = build.pack_root(src, recipe("a"), tmp_path / "a.tar.zst")
    assert workspace.Workspace.of(art, src) is None
    shutil.rmtree(src)
    restore.restore_file(tmp_path / "a.tar.zst", src)
    assert (src / "flashinfer").is_dir() and not (src / "flashinfer").is_symlink()
    assert not (src.parent / workspace.SHARED).exists()


def test_another_root_base_restores_the_workspace_into_the_root(node, tmp_path):
    """A node whose roots sit elsewhere than the build's cannot share the build's path: the files go
    into the root, as for an older artifact (and the outlook says FlashInfer rebuilds)."""
    store, base, a, b, b_files = node
    elsewhere = tmp_path / "elsewhere" / "a"
    got = fetch.fetch(recipe("a"), store, elsewhere)
    assert got.status == "hit" and (elsewhere / "flashinfer").is_dir()
    assert not (elsewhere / "flashinfer").is_symlink()
    assert any("workspace real path" in w for w in got.warnings)


# -- the real thing: nvcc builds the module for sm_90a on two builders, the node calls nvcc 0 times --

@pytest.fixture(scope="module")
def counted_cuda(tmp_path_factory):
    got = counted_nvcc.make(tmp_path_factory.mktemp("nvcc"), CUDA_HOME)
    if isinstance(got, str):
        pytest.skip(got)
    return got


BUILD = ("from flashinfer.jit.activation import gen_act_and_mul_module\n"
         "gen_act_and_mul_module('silu').build(verbose=False)\n")


def test_a_second_recipe_reuses_the_first_ones_nvcc_built_module_with_0_bytes_and_0_nvcc_calls(
    tmp_path, counted_cuda
):
    """#30's Done-when: two recipes, each built on its own builder (nvcc compiles silu_and_mul for
    sm_90a twice, so the two FlashInfer layers differ), published layered. On the node, the second
    recipe's FlashInfer layer is not downloaded, and loading the module there calls nvcc 0 times."""
    home, jit_env = counted_cuda
    base = tmp_path / "cache"
    store = open_store(f"file://{tmp_path / 'store'}")
    arts = {}
    for name in ("a", "b"):
        root = base / name
        make_cache_tree(root)
        workspace.link(root, flashinfer.contract(root, {**os.environ, **jit_env}))
        env = {**os.environ, **jit_env, **components.BY_NAME["flashinfer"].env_under(root)}
        before = counted_nvcc.compiles(home)
        run_python("-c", BUILD, env=env)
        assert counted_nvcc.compiles(home) > before, "the builder compiled nothing: the test proves nothing"
        arts[name] = _pack(root, name, {}, tmp_path / f"{name}.tar.zst", jit_env)
        build.publish(store, tmp_path / f"{name}.tar.zst", layers=True)
        shutil.rmtree(base)
    a, b = arts["a"], arts["b"]
    assert a.path_contract.flashinfer.modules == b.path_contract.flashinfer.modules == ("silu_and_mul",)
    assert a.layer("flashinfer").sha256 != b.layer("flashinfer").sha256  # two builds, not one layer twice

    served = {**os.environ, **jit_env}
    first = fetch.fetch(recipe("a"), store, base / "a", serving_env=served)
    assert first.status == "hit" and first.flashinfer["clean"] is True, first.warnings
    second = fetch.fetch(recipe("b"), store, base / "b", serving_env=served)
    assert second.status == "hit" and "flashinfer" in second.restore.reused, second.warnings
    others = sum(layer.size for layer in b.layers if layer.component != "flashinfer")
    assert second.restore.archive_bytes == others  # 0 bytes of FlashInfer's layer
    assert second.flashinfer["clean"] is True  # ninja: no work to do

    before = counted_nvcc.compiles(home)
    run_python("-c", BUILD, env={**served, **second.env.vars})
    assert counted_nvcc.compiles(home) == before  # 0 nvcc calls: the module a's artifact brought was loaded


def test_a_link_planted_in_the_workspace_is_never_written_through(node, tmp_path):
    """The workspace is writable by every pod of the node; a restore (run as root on a node) must not
    follow a link someone put there: the restore is refused, the root as it was, and the link's
    target untouched."""
    store, base, a, b, b_files = node
    assert fetch.fetch(recipe("a"), store, base / "a").status == "hit"
    ws = Path(os.path.realpath(base / "a" / "flashinfer"))
    ops = ws / MODULE_DIR.removeprefix("flashinfer/") / "cached_ops"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(ops)
    ops.symlink_to(elsewhere)

    got = fetch.fetch(recipe("b"), store, base / "b")
    assert got.status == "error" and any("is not a directory" in w for w in got.warnings), got.warnings
    assert list(elsewhere.iterdir()) == [] and not (base / "b" / restore.MARKER).exists()


def test_on_one_builder_the_second_recipes_warm_up_compiles_its_module_with_nvcc_again(tmp_path, counted_cuda):
    """The cold build for real: one builder builds a, then b, at one root base, and both load
    silu_and_mul. b's warm-up calls nvcc as often as a's did (without the set-aside it loaded a's module:
    0 calls, a cold time that was not cold), and both artifacts list the module."""
    home, jit_env = counted_cuda
    base = tmp_path / "cache"
    compiled, arts = {}, {}
    for name in ("a", "b"):
        root = base / name
        make_cache_tree(root)
        with build.cold_flashinfer(recipe(name), root, jit_env):
            before = counted_nvcc.compiles(home)
            run_python("-c", BUILD, env={**os.environ, **jit_env, **components.BY_NAME["flashinfer"].env_under(root)})
            compiled[name] = counted_nvcc.compiles(home) - before
            arts[name] = _pack(root, name, {}, tmp_path / f"{name}.tar.zst", jit_env)
    assert compiled["a"] > 0, "the builder compiled nothing: the test proves nothing"
    assert compiled["b"] == compiled["a"]
    assert arts["a"].path_contract.flashinfer.modules == arts["b"].path_contract.flashinfer.modules == ("silu_and_mul",)
    assert arts["a"].layer("flashinfer").sha256 != arts["b"].layer("flashinfer").sha256


# -- a pod of the node (W is handed to --owner) swaps a directory of W for a link between a check and its use --


def _pod_swaps(monkeypatch, call: str, name: str, d: Path, outside: Path) -> None:
    """os.<call> wrapped: right before its first call on a path that holds name, d (checked already) is moved
    aside and a link to outside put in its place, as a pod that renames in a loop would time it."""
    real = getattr(os, call)

    def pod_then_call(path, *args, **kwargs):
        if name in str(path) and not d.is_symlink():
            d.rename(d.with_name(d.name + ".aside"))
            d.symlink_to(outside)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, pod_then_call)


@pytest.mark.parametrize(
    "call, swapped, name",
    [
        ("replace", "ws/.cache/flashinfer/autotune", "tune.json"),  # the unit's file moved in
        ("unlink", "ws/.cache/flashinfer/autotune", "tune.json"),  # its old copy removed first (_clear)
        ("open", f"ws/{MODULE_DIR[len(workspace.PREFIX) :]}/cached_ops/tmp", "silu_and_mul.lock"),  # FlashInfer's lock
        ("open", "origins", ".json."),  # the origin's artifact.json, through its temporary file
    ],
    ids=["move", "remove", "lock", "origin"],
)
def test_a_root_restore_acts_on_nothing_outside_the_workspace_through_a_directory_a_pod_swaps_after_the_check(
    tmp_path, monkeypatch, call, swapped, name
):
    """adopt runs as root; each file it moves in (its name and bytes the store's), removes, creates or writes
    stays in W though a pod swaps the directory for a link to (say) /etc/cron.d after its check (was: the
    file moved there, the pod's file of that name removed, the lock or origin made there; real races, renameat2
    in a loop, won 18 to 44 times in 10 s: /tmp/review2-ws-races/)."""
    base = tmp_path / "cache"
    tune = {f"flashinfer/{flashinfer.CACHE}/autotune/tune.json": b"* * * * * root sh /tmp/x\n"}
    art = _pack(base / "a", "a", {**_module("silu_and_mul", os.urandom(1000)), **tune}, tmp_path / "a.tar.zst")
    ws = workspace.Workspace(Path(os.path.realpath(base / "a" / "flashinfer")).parent)
    shutil.copytree(ws.path, tmp_path / "staged")
    (ws.top / "units.json").unlink(missing_ok=True)  # no unit has an origin: each moves in again
    (ws.top / swapped).mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tune.json").write_text("the pod's victim")
    _pod_swaps(monkeypatch, call, name, ws.top / swapped, outside)
    with suppress(archive.ArchiveError):  # refused when it meets the link later, or not: nothing outside either way
        ws.adopt(tmp_path / "staged", art, None)
    assert (ws.top / swapped).is_symlink()  # the pod did swap it
    assert [p.name for p in outside.iterdir()] == ["tune.json"]
    assert (outside / "tune.json").read_text() == "the pod's victim"


def test_a_build_merges_nothing_back_outside_the_workspace_through_a_directory_a_pod_swaps_after_the_check(
    tmp_path, monkeypatch
):
    """merge_back (a build, after its pack) moves what set_aside moved out back into W file by file; a pod
    that swaps W's directory for a link after its check gets nothing moved there (was: the file moved out of W;
    a real race won 328 times in 10 s)."""
    ws = workspace.Workspace(tmp_path / "cache" / workspace.SHARED / "0123456789abcdef")
    tune = ".cache/flashinfer/autotune"
    (ws.path / tune).mkdir(parents=True)
    (ws.path / tune / "built.json").write_text("{}")  # the build's
    aside = ws.top / f"{workspace.ASIDE}0"
    (aside / tune).mkdir(parents=True)
    (aside / tune / "old.json").write_text("{}")  # what W held before the build
    outside = tmp_path / "outside"
    outside.mkdir()
    _pod_swaps(monkeypatch, "replace", "old.json", ws.path / tune, outside)
    ws.merge_back(aside)
    assert list(outside.iterdir()) == []
    assert (ws.path / f"{tune}.aside" / "old.json").exists() and not aside.exists()  # moved where checked


def test_a_set_aside_copy_a_pod_planted_as_a_link_is_refused_not_merged_in(tmp_path):
    """A build merges back what an interrupted build left beside W (ws.aside-*); one that is a link, which a
    pod (top is handed to --owner) can plant, is refused, and nothing is taken from where it leads (was: every
    file there, /etc/shadow say, moved into W, which every pod reads)."""
    ws = workspace.Workspace(tmp_path / "cache" / workspace.SHARED / "0123456789abcdef")
    ws.path.mkdir(parents=True)
    secret = tmp_path / "etc"
    secret.mkdir()
    (secret / "shadow").write_text("root:$6$...\n")
    (ws.top / f"{workspace.ASIDE}pod").symlink_to(secret)
    with pytest.raises(archive.ArchiveError, match="is not a directory"):
        ws.set_aside()
    assert (secret / "shadow").exists() and list(ws.path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="hands the workspace to --owner: needs root")
def test_a_root_restore_hands_nothing_outside_the_workspace_to_the_owner_through_a_directory_a_pod_swaps(
    node, tmp_path, monkeypatch
):
    """A restore as root hands W to --owner file by file; a pod that swaps a directory of W holding a file named
    as its victim for a link to the victim's directory, between the walk and the hand-over, gets nothing outside
    W (was: /etc/shadow, say, handed to the pod's uid: lchown follows a directory above the file; a real race,
    renameat2 in a loop, won within 7 hand-overs)."""
    store, base, a, b, _ = node
    # Active and handed over ("unwritable" all the same: uid 1000 cannot get through pytest's 0700
    # directories above the root, which is not this test's point).
    assert fetch.fetch(recipe("a"), store, base / "a", owner=(1000, 1000)).status in ("hit", "unwritable")
    assert restore.active(base / "a") is not None
    pods = Path(os.path.realpath(base / "a" / "flashinfer")) / "pod"
    pods.mkdir()
    (pods / "shadow").write_text("the pod's")
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "shadow").write_text("root:$6$...\n")  # root's
    for call in ("lchown", "chown"):
        _pod_swaps(monkeypatch, call, "shadow", pods, outside)
    fetch.fetch(recipe("b"), store, base / "b", owner=(1000, 1000))
    assert pods.is_symlink()  # the pod did swap it
    assert os.stat(outside / "shadow").st_uid == 0


def test_two_toolkits_at_one_cuda_home_path_get_workspaces_of_their_own(tmp_path):
    """Two images on one node, nvcc 12.9 and 13.0 both at /usr/local/cuda, the same FlashInfer: one
    workspace key, so each recipe's fetch took the other's modules as its own (a clean dry run), and
    vLLM loaded a .so built by the other toolkit (another CUDA runtime) or rebuilt it on every start.
    nvcc's version is in the key: a workspace of each."""
    if not HAS_FLASHINFER:
        pytest.skip("flashinfer-python is not installed")
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"

    def key_with(release: str) -> str:
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.41'\n")
        nvcc.chmod(0o755)
        contract = flashinfer.contract(tmp_path / "root", {**os.environ, "CUDA_HOME": str(home)})
        assert contract is not None and contract.nvcc == release
        return workspace.key(contract)

    assert key_with("12.9") != key_with("13.0") == key_with("13.0")
    # An artifact's contract records it; one recorded before it was (no nvcc) keys as it did.
    contract = flashinfer.contract(tmp_path / "root", {**os.environ, "CUDA_HOME": str(home)})
    old = flashinfer.FlashInferContract(**{**vars(contract), "nvcc": None})
    assert "nvcc" not in json.dumps({k: v for k, v in vars(old).items() if v is not None})
    assert workspace.key(old) != workspace.key(contract)
