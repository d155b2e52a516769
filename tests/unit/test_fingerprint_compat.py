"""The probe on this machine, the key, volatile recipe env, and `warmer explain` over a file store.

The GPU and CPU matrix of other machines is in test_fixture_matrix.py.
"""

import json
import sys
import zipfile

import pytest

from tests.conftest import make_cache_tree, run_python, run_warmer, tiny_recipe, write_tiny_recipe
from tests.fixtures import nodes
from warmer import build, compat, explain, fetch, fingerprint, restore
from warmer.store import open_store



def test_probe_describes_this_machine():
    fp = fingerprint.probe(root="/srv/warm", model="/models/tiny").to_json()
    assert fp["machine"] and fp["os"] == "Linux" and fp["python"].count(".") == 2
    assert fp["glibc"] and fp["glibc"][0].isdigit()
    assert fp["cpu"]["threads"] >= 1 and fp["cpu"]["logical"] >= fp["cpu"]["threads"] and fp["cpu"]["isa"]
    assert fp["paths"]["python_prefix"] == sys.prefix
    assert (fp["paths"]["cache_root"], fp["paths"]["model"]) == ("/srv/warm", "/models/tiny")
    assert fp["packages"]["torch"].endswith("+cpu") and fp["torch_cuda"] is None  # the CPU test environment
    assert fp["gpu"]["count"] == 0 and fp["gpu"]["notes"]  # says why no GPU was found
    assert not compat.unfit_reasons(fingerprint.Fingerprint.from_json(fp))
    json.dumps(fp)


def test_node_path_imports_neither_torch_nor_vllm():
    code = ("import sys, warmer.cli, warmer.fetch, warmer.restore, warmer.explain; from warmer import fingerprint; "
            "fingerprint.probe(); print(sorted(m for m in ('torch', 'vllm', 'transformers', 'flashinfer') "
            "if m in sys.modules))")
    out = run_python("-c", code).stdout
    assert out.strip() == "[]"


def test_torch_cuda_is_read_from_torch_version_py(tmp_path, monkeypatch):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.10.0+cu129'\ncuda: Optional[str] = '12.9'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # found on the path, not among imported modules
    assert fingerprint._torch_cuda() == "12.9"


def test_key_is_stable_and_follows_hard_fields():
    r = tiny_recipe().identity()
    h200 = nodes.gpu_node("h200")
    assert compat.key(h200, r) == compat.key(fingerprint.Fingerprint.from_json(h200.to_json()), r)
    assert compat.key(nodes.gpu_node("h100-sxm"), r) != compat.key(h200, r)
    assert compat.key(h200, tiny_recipe(max_num_seqs=2).identity()) != compat.key(h200, r)
    for field, value in (("python", "3.12.12"), ("torch_cuda", "12.8")):
        assert compat.key(nodes.edit(h200, **{field: value}), r) != compat.key(h200, r), field
    other_torch = nodes.edit(h200, **{"packages.torch": "2.10.1+cu129"})
    assert compat.key(other_torch, r) != compat.key(h200, r)
    # Recorded, never decisive: the paths of this run and the GPU's memory.
    moved = nodes.edit(h200, **{"paths.cache_root": "/elsewhere", "gpu.memory_mib": 1})
    assert compat.key(moved, r) == compat.key(h200, r) and compat.fits(compat.decisions(h200, moved))


def test_every_rule_says_why():
    node = nodes.gpu_node("h200")
    decisions = compat.decisions(node, node)
    assert compat.fits(decisions)
    assert all(d.why for d in decisions)
    kinds = {d.field: d.kind for d in decisions}
    assert kinds["gpu.name"] == compat.HARD and kinds["cpu.threads"] == compat.ADVISORY  # a GPU node
    assert kinds["gpu.driver"] == compat.RANGED and kinds["cpu.model"] == compat.ADVISORY
    assert kinds["packages.flashinfer-python"] == kinds["nvcc"] == compat.HARD  # FlashInfer JIT-builds on GPUs
    cpu = nodes.cpu_node("amd-genoa")
    assert {d.field: d.kind for d in compat.decisions(cpu, cpu)}["nvcc"] == compat.ADVISORY


def test_volatile_recipe_env_stays_out_of_the_key_and_warns():
    plain = tiny_recipe()
    pod = tiny_recipe()
    pod.env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.3.17", "MY_SETTING": "fd00::1:2:3",
                    "VLLM_LOOPBACK_IP": "127.0.0.1"})
    other_pod = tiny_recipe()
    other_pod.env.update({"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.9.4", "MY_SETTING": "fd00::9:9:9",
                          "VLLM_LOOPBACK_IP": "127.0.0.1"})
    node = nodes.cpu_node("amd-genoa")
    assert compat.key(node, pod.identity()) == compat.key(node, other_pod.identity())
    assert compat.key(node, pod.identity()) != compat.key(node, plain.identity())  # the loopback IP is kept
    warnings = compat.volatile_warnings(pod.env)
    assert len(warnings) == 2
    assert any("VLLM_NIXL_SIDE_CHANNEL_HOST" in w and "ai-dynamo/dynamo#10695" in w for w in warnings)
    assert not compat.volatile_warnings(plain.env)


@pytest.fixture
def store_of_four(tmp_path):
    """Four artifacts of the tiny recipe: one built here, one for an AVX2 host, one for an H200 node,
    one from another version of the recipe."""
    root = tmp_path / "build-root"
    make_cache_tree(root)
    store = open_store(f"file://{tmp_path / 'store'}")
    here = fingerprint.probe(root=root, model="/models/tiny")
    avx2 = nodes.edit(here, **{"cpu.isa": nodes.cpu_section("intel-broadwell")["isa"]})
    h200 = nodes.gpu_node("h200")
    built = {}
    for name, fp, recipe in (("here", here, tiny_recipe()), ("avx2", avx2, tiny_recipe()),
                             ("h200", h200, tiny_recipe()), ("older", here, tiny_recipe(max_num_seqs=2))):
        art = tmp_path / f"{name}.tar.zst"
        built[name] = build.pack_root(root, recipe, art, fp=fp).key
        build.publish(store, art)
    return store, built


def test_explain_ranks_every_artifact_and_gives_a_reason_per_rejected_field(store_of_four):
    store, built = store_of_four
    node = fingerprint.probe(model="/models/tiny")
    result = explain.explain(store, tiny_recipe(), node).to_json()
    keys = [c["key"] for c in result["candidates"]]
    assert (result["accepted"], result["rejected"]) == (1, 3)
    assert keys[0] == built["here"] == result["node_key"] and result["candidates"][0]["exact"]
    # Nearest first: one hard field (the ISA, or the recipe's max_num_seqs) before an H200 node.
    assert set(keys[1:3]) == {built["avx2"], built["older"]} and keys[3] == built["h200"]
    for c in result["candidates"][1:]:
        bad = [d for d in c["decisions"] if not d["ok"]]
        assert bad and all(d["reason"] and d["why"] and d["reason"] != "same" for d in bad)
    by_key = {c["key"]: c for c in result["candidates"]}
    assert by_key[built["avx2"]]["failed"]["hard"] == ["cpu.isa"]
    assert by_key[built["older"]]["failed"]["hard"] == ["recipe.engine.max_num_seqs"]
    assert {"gpu.name", "gpu.compute_capability", "machine"} & set(by_key[built["h200"]]["failed"]["hard"])
    isa = next(d for d in by_key[built["avx2"]]["decisions"] if d["field"] == "cpu.isa")
    only_here = sorted(set(fingerprint.probe().cpu.isa) - set(nodes.cpu_section("intel-broadwell")["isa"]))
    assert isa["reason"] == "only on this node: " + ", ".join(only_here)


def test_cli_explain_in_words_and_json(store_of_four, tmp_path):
    store, built = store_of_four
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    words = run_warmer("explain", recipe, "--store", store.url)
    assert words.returncode == 0, words.stderr
    assert "1 accepted, 3 rejected" in words.stdout
    assert [ln.split()[0] for ln in words.stdout.splitlines() if ln.startswith(("ACCEPTED", "rejected"))] == \
        ["ACCEPTED", "rejected", "rejected", "rejected"]
    assert "cpu.isa [hard]: only on this node" in words.stdout and "why: Inductor's CPU cache" in words.stdout
    doc = json.loads(run_warmer("explain", recipe, "--store", store.url, "--json").stdout)
    assert doc["candidates"][0]["key"] == built["here"] and doc["candidates"][0]["accepted"]


def test_fetch_miss_names_the_nearest_artifacts_differences(store_of_four, tmp_path, monkeypatch):
    store, built = store_of_four
    milan = nodes.edit(fingerprint.probe(), **{"cpu.isa": nodes.cpu_section("amd-milan")["isa"]})  # AVX2
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: milan)
    got = fetch.fetch(tiny_recipe(), store.url, tmp_path / "node").to_json()
    assert got["status"] == "miss" and got["nearest"]["key"] in (built["here"], built["avx2"])
    [difference] = got["nearest"]["differences"]
    assert difference.startswith("cpu.isa: ") and "on this node: " in difference
    assert [p.name for p in (tmp_path / "node").rglob("*") if p.is_file()] == [restore.PREPARED]  # nothing restored


def test_fetch_on_a_node_with_mixed_gpus_looks_nothing_up(store_of_four, tmp_path, monkeypatch):
    store, _ = store_of_four
    fx = nodes.gpu_fixture("mixed-h100-l40s")
    mixed = nodes.gpu_node("h100-pcie").with_gpus(
        fingerprint.gpu_section(fingerprint.read_nvml(nodes.FakeNVML(fx["nvml"])), "12.9", None, []))
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: mixed)
    got = fetch.fetch(tiny_recipe(), store.url, tmp_path / "node").to_json()
    assert got["status"] == "miss" and "nearest" not in got
    assert any("GPUs differ from each other" in w for w in got["warnings"])
    with pytest.raises(build.BuildError, match="GPUs differ"):
        build.pack_root(tmp_path / "node", tiny_recipe(), tmp_path / "x.tar.zst", fp=mixed)


def test_an_image_build_without_the_gpu_fetches_for_a_saved_fingerprints_gpus(tmp_path):
    """The release pipeline's case: the CI build ran in the serving image on an H200 node; the image
    is baked on a machine with no GPU (this one), which takes the GPUs from a node's saved fingerprint."""
    root = tmp_path / "build-root"
    files = make_cache_tree(root)
    h200_node = nodes.gpu_node("h200")
    built = fingerprint.probe(root=root, model="/models/tiny").with_gpus(h200_node.gpu)
    art = tmp_path / "h200.tar.zst"
    build.pack_root(root, tiny_recipe(), art, fp=built)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)

    assert fetch.fetch(tiny_recipe(), store, tmp_path / "plain").status == "miss"  # no GPU here
    saved = tmp_path / "h200-node.json"
    saved.write_text(json.dumps(h200_node.to_json()))  # what `warmer fingerprint --json` printed on the node
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    out = run_warmer("fetch", recipe, "--store", store.url, "--root", tmp_path / "image-root", "--require",
                     "--gpus-from", saved)
    assert out.returncode == 0, out.stderr
    assert f"for GPUs: {h200_node.gpu.count} x NVIDIA H200 (sm 9.0" in out.stderr
    rel = next(r for r in files if r.endswith(".so"))
    assert (tmp_path / "image-root" / rel).read_bytes() == files[rel]

    # A fingerprint without GPUs (this machine's), or no fingerprint at all, is refused by name.
    here = tmp_path / "here.json"
    here.write_text(run_warmer("fingerprint", "--json").stdout)
    (tmp_path / "junk.json").write_text("GPU: H200")
    for bad, says in ((here, "describes no GPU"), (tmp_path / "junk.json", "is not a fingerprint"),
                      (tmp_path / "absent.json", "cannot read the fingerprint file")):
        out = run_warmer("fetch", recipe, "--store", store.url, "--root", tmp_path / "r2", "--gpus-from", bad)
        assert out.returncode == 2 and says in out.stderr and "warmer fingerprint --json >" in out.stderr  # usage
        assert "Traceback" not in out.stderr


def test_a_cpu_artifact_built_where_a_driver_answered_without_a_gpu_fits_a_node_without_one(tmp_path, monkeypatch):
    """A CPU recipe built in a pod that sees the NVIDIA driver but no GPU (CUDA_VISIBLE_DEVICES="", or
    NVIDIA_VISIBLE_DEVICES=none on a GPU node): NVML answers with the driver's versions and no device.
    Nothing the build compiled runs on a GPU, so a CPU-only node (no driver at all) must get it."""
    root = tmp_path / "build-root"
    files = make_cache_tree(root)
    here = fingerprint.probe(root=root, model="/models/tiny")
    driver_only = fingerprint.gpu_section(fingerprint.read_nvml(nodes.FakeNVML(nodes.gpu_fixture("h200")["nvml"])),
                                          None, "", [])
    assert (driver_only.count, driver_only.driver) == (0, "570.133.20")
    art = tmp_path / "cpu.tar.zst"
    build.pack_root(root, tiny_recipe(), art, fp=here.with_gpus(driver_only))
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)

    no_driver = here.with_gpus(fingerprint.gpu_section(None, None, None, ["NVML: not installed"]))
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: no_driver)
    got = fetch.fetch(tiny_recipe(), store.url, tmp_path / "node")
    assert got.status == "hit", got.warnings
    rel = next(r for r in files if r.endswith(".so"))
    assert (tmp_path / "node" / rel).read_bytes() == files[rel]
    driver = next(d for d in compat.decisions(here.with_gpus(driver_only), no_driver) if d.field == "gpu.driver")
    assert driver.ok and driver.reason == "the build had no GPU"
    # A GPU artifact still needs the driver.
    h200 = nodes.gpu_node("h200")
    assert not compat.fits(compat.decisions(h200, nodes.edit(h200, **{"gpu.driver": None})))


def _two_dist_infos(site, versions, *, zipped=False):
    """A site dir (or a zipped one) holding two dist-infos of triton, in this order: an upgrade that
    left the old one behind."""
    members = {f"triton-{v}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: triton\nVersion: {v}\n"
               for v in versions}
    members["triton/__init__.py"] = "__version__ = '3.9.1'\n"
    if zipped:
        with zipfile.ZipFile(site, "w") as z:  # a zip lists its members in the order written
            for name, text in members.items():
                z.writestr(name, text)
        return site
    for name, text in members.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    return site


def test_two_dist_infos_of_a_package_give_every_node_the_same_version(tmp_path, monkeypatch):
    """importlib.metadata takes the dist-info its directory lists first, and directory order differs
    between filesystems (a zip's member order stands in for it here): nodes of one image must agree."""
    got = set()
    for i, order in enumerate((("3.9.0", "3.9.1"), ("3.9.1", "3.9.0"))):
        for zipped in (False, True):
            site = tmp_path / f"site{i}{'.zip' if zipped else ''}"
            if not zipped:
                site.mkdir()
            with monkeypatch.context() as m:
                m.syspath_prepend(str(_two_dist_infos(site, order, zipped=zipped)))
                got.add(fingerprint._package_versions()["triton"])
    assert got == {"3.9.1"}
    # A copy further down sys.path is shadowed, as it is for imports.
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir(), later.mkdir()
    _two_dist_infos(first, ("3.9.0",))
    _two_dist_infos(later, ("3.10.0",))
    monkeypatch.syspath_prepend(str(later))
    monkeypatch.syspath_prepend(str(first))
    assert fingerprint.installed_version("triton") == "3.9.0"
    assert fingerprint.installed_version("no-such-distribution") is None


def test_flashinfers_contract_takes_the_version_the_fingerprint_takes(tmp_path, monkeypatch):
    """Two dist-infos of flashinfer-python: the contract's version (in the shared workspace's key, and
    compared by `verify`'s FlashInfer check) followed the zip's (the directory's) order, where the
    fingerprint took the highest, so a node said FlashInfer would rebuild against a version it runs."""
    from warmer.components import flashinfer

    got = set()
    for i, order in enumerate((("0.2.7", "0.2.8"), ("0.2.8", "0.2.7"))):
        site = tmp_path / f"site{i}.zip"
        with zipfile.ZipFile(site, "w") as z:  # a zip lists its members in the order written
            for v in order:
                z.writestr(f"flashinfer_python-{v}.dist-info/METADATA",
                           f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {v}\n")
            z.writestr("flashinfer/__init__.py", "")
        with monkeypatch.context() as m:
            m.syspath_prepend(str(site))
            fi = flashinfer.contract(tmp_path, {})
            assert fi is not None and fi.version == fingerprint.installed_version("flashinfer-python")
            got.add(fi.version)
    assert got == {"0.2.8"}


def test_a_package_whose_metadata_is_not_utf8_is_unknown_not_a_failed_probe(tmp_path, monkeypatch):
    """One dist-info METADATA with a latin-1 byte (a hand-made or broken install of ninja, say): the
    probe raised UnicodeDecodeError and the init container's fetch exited 1 with a traceback."""
    dist = tmp_path / "ninja-1.11.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: ninja\nVersion: 1.11.1\n\nDescription caf\xe9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fingerprint.installed_version("ninja") is None
    assert fingerprint.probe().packages.get("ninja") is None
