"""One layer per cache component: each fits a node on the fields its own loader checks
(compat.LAYER_RULES), its layer key follows exactly those, and `warmer explain` says per layer
which field decides it."""

import itertools
import json

import pytest

from tests.conftest import tiny_recipe
from tests.fixtures import nodes
from warmer import compat, components, explain, fingerprint
from warmer.artifact import Artifact, ComponentSummary, RecipeRef
from warmer.archive import FileEntry
from warmer.cli import explain as cli_explain
from warmer.contract import PathContract
from warmer.entry import BlobRef, IndexEntry

RECIPE = tiny_recipe().identity()
SXM = nodes.gpu_node("h100-sxm")


def failed(component, built, node, built_identity=RECIPE, identity=RECIPE):
    return [d for d in compat.layer_decisions(component, built, node, built_identity, identity) if not d.ok]


def fields(decisions):
    return [d.field for d in decisions]


# -- the rules ----------------------------------------------------------------------------------


def test_every_layer_rule_is_a_components_and_names_fields_compat_knows():
    known = {r.field for r in compat.RULES} | {f"packages.{p}" for p in fingerprint.PACKAGES}
    assert set(compat.LAYER_RULES) <= set(components.BY_NAME)
    for name, rule in compat.LAYER_RULES.items():
        assert rule.component == name
        for f in rule.fields:
            if f == "*" or f.endswith(".*"):
                assert f == "*" or any(k.startswith(f[:-1]) for k in known), (name, f)
            else:
                assert f in known, (name, f)  # a misspelt field would silently decide nothing
        assert all(rule.names(h) for h in rule.hard), name
        assert ".py" in rule.why or "Guide" in rule.why, name  # cited: file and function


def test_each_rule_takes_what_its_loader_checks_and_nothing_else():
    triton, fi, inductor = (compat.layer_rule(n) for n in ("triton", "flashinfer", "inductor"))
    assert "gpu.name" not in triton.fields and "gpu.name" not in fi.fields and "gpu.name" in inductor.fields
    assert {"packages.triton", "gpu.compute_capability", "python", "machine", "os"} <= set(triton.fields)
    assert {"packages.flashinfer-python", "packages.apache-tvm-ffi", "packages.flashinfer-cubin", "gpu.arch",
            "nvcc", "ninja", "paths.flashinfer", "paths.python_prefix", "paths.cuda_home"} <= set(fi.fields)
    assert (triton.recipe, fi.recipe, inductor.recipe, compat.layer_rule("vllm").recipe) == (False, False, True, True)
    assert compat.layer_rule("vllm").fields == ("*",)
    assert compat.layer_rule("cuda").hard == ("gpu.driver",)
    # No rule of its own: the whole artifact's rules and the recipe.
    for name in set(components.BY_NAME) - set(compat.LAYER_RULES):
        rule = compat.layer_rule(name)
        assert (rule.fields, rule.recipe) == (("*",), True), name
        assert fields(compat.layer_decisions(name, SXM, SXM, None, None)) == fields(compat.decisions(SXM, SXM))


# -- per-SKU decisions on fixture fingerprints ----------------------------------------------------


@pytest.mark.parametrize("sku", ["h100-pcie", "h200"])
def test_an_h100_sxm_build_gives_another_hopper_its_flashinfer_and_triton_layers(sku):
    node = nodes.gpu_node(sku)
    assert not compat.fits(compat.decisions(SXM, node, RECIPE))  # the whole artifact does not fit
    for name in ("flashinfer", "triton"):
        assert compat.layer_fits(name, SXM, node, RECIPE, RECIPE), (name, failed(name, SXM, node))
    for name in ("inductor", "inductor-headers", "vllm", "b12x"):
        assert not compat.layer_fits(name, SXM, node, RECIPE, RECIPE), name
    [why] = failed("inductor", SXM, node)
    assert why.field == "gpu.name" and why.kind == compat.HARD
    assert why.node == node.gpu.name and why.built == SXM.gpu.name
    assert fields(failed("vllm", SXM, node)) == ["gpu.name"]
    # b12x keys on the SM count (132 on SXM, 114 on PCIe), which only the GPU's name records.
    assert fields(failed("b12x", SXM, node)) == ["gpu.name"]


def test_the_driver_cache_wants_the_same_driver_where_the_artifact_wants_one_as_new():
    h200 = nodes.gpu_node("h200")  # driver 570.133.20 against the build's 570.124.06
    whole = {d.field: d for d in compat.decisions(SXM, h200)}
    assert whole["gpu.driver"].kind == compat.RANGED and whole["gpu.driver"].ok
    [driver] = failed("cuda", SXM, h200)
    assert (driver.field, driver.kind, driver.built, driver.node) == ("gpu.driver", compat.HARD, "570.124.06",
                                                                      "570.133.20")
    assert "ComputeCache" in driver.why  # the layer's reason, not the whole rule's "a newer driver runs"
    assert compat.layer_fits("cuda", SXM, nodes.gpu_node("h100-pcie"), None, None)  # the same driver
    assert compat.layer_fits("triton", SXM, h200, None, None)  # ranged there: a newer driver runs it


def test_an_ampere_node_gets_neither_flashinfer_nor_triton():
    a100 = nodes.gpu_node("a100")
    assert "gpu.arch" in fields(failed("flashinfer", SXM, a100))
    assert "gpu.compute_capability" in fields(failed("triton", SXM, a100))
    # With the build's driver, the GPU alone decides: its arch tag and its compute capability.
    same_driver = nodes.edit(a100, **{"gpu.driver": SXM.gpu.driver, "gpu.cuda_driver": SXM.gpu.cuda_driver})
    assert fields(failed("flashinfer", SXM, same_driver)) == ["gpu.arch"]
    assert fields(failed("triton", SXM, same_driver)) == ["gpu.compute_capability"]
    assert fields(failed("cuda", SXM, same_driver)) == ["gpu.compute_capability"]


def test_another_flashinfer_misfits_flashinfer_and_leaves_triton_and_inductor_be():
    other = nodes.edit(SXM, **{"packages.flashinfer-python": "0.7.3"})
    [why] = failed("flashinfer", SXM, other)
    assert (why.field, why.built, why.node) == ("packages.flashinfer-python", "0.7.2.post1", "0.7.3")
    assert compat.layer_fits("triton", SXM, other, RECIPE, RECIPE)
    assert compat.layer_fits("inductor", SXM, other, RECIPE, RECIPE)
    assert fields(failed("vllm", SXM, other)) == ["packages.flashinfer-python"]
    moved = nodes.edit(SXM, **{"paths.flashinfer": "/usr/lib/python3/dist-packages/flashinfer"})
    assert fields(failed("flashinfer", SXM, moved)) == ["paths.flashinfer"]
    assert compat.layer_fits("inductor", SXM, moved, RECIPE, RECIPE)


def test_the_recipe_enters_only_the_layers_whose_entries_are_its_own():
    other = tiny_recipe(max_num_seqs=2).identity()
    assert fields(failed("inductor", SXM, SXM, RECIPE, other)) == ["recipe.engine.max_num_seqs"]
    assert fields(failed("vllm", SXM, SXM, RECIPE, other)) == ["recipe.engine.max_num_seqs"]
    for name in ("triton", "flashinfer", "cuda"):
        assert compat.layer_fits(name, SXM, SXM, RECIPE, other), name
    assert compat.layer_fits("inductor", SXM, SXM, None, other)  # no built identity given: fields only


def test_inductor_on_a_cpu_backend_decides_on_the_isa():
    genoa, broadwell = nodes.cpu_node("amd-genoa"), nodes.cpu_node("intel-broadwell")
    assert "cpu.isa" in fields(failed("inductor", genoa, broadwell))
    kinds = {d.field: d.kind for d in compat.layer_decisions("inductor", genoa, genoa, None, None)}
    assert kinds["cpu.isa"] == compat.HARD and kinds["cpu.threads"] == kinds["cpu.model"] == compat.ADVISORY
    gpu_kinds = {d.field: d.kind for d in compat.layer_decisions("inductor", SXM, SXM, None, None)}
    assert gpu_kinds["cpu.isa"] == compat.ADVISORY  # hard only on CPU backends, as for the whole artifact


# -- the layer key --------------------------------------------------------------------------------

FINGERPRINTS = {
    "h100-sxm": SXM,
    "h100-pcie": nodes.gpu_node("h100-pcie"),
    "h200": nodes.gpu_node("h200"),
    "a100": nodes.gpu_node("a100"),
    "gh200-like": nodes.edit(SXM, machine="aarch64"),
    "other-flashinfer": nodes.edit(SXM, **{"packages.flashinfer-python": "0.7.3"}),
    "other-triton": nodes.edit(SXM, **{"packages.triton": "3.5.1"}),
    "other-python": nodes.edit(SXM, python="3.12.12"),
    "other-prefix": nodes.edit(SXM, **{"paths.python_prefix": "/venv"}),
    "other-nvcc": nodes.edit(SXM, nvcc="12.8"),
    "other-driver": nodes.edit(SXM, **{"gpu.driver": "575.57.08"}),
    "no-flashinfer": nodes.gpu_node("h100-sxm", packages={"vllm": "0.32.0", "torch": "2.10.0+cu129",
                                                          "triton": "3.5.0", "transformers": "5.19.0"}),
    "genoa": nodes.cpu_node("amd-genoa"),
    "broadwell": nodes.cpu_node("intel-broadwell"),
    "genoa-1-thread": nodes.cpu_node("amd-genoa", {"OMP_NUM_THREADS": "1"}),
}
LAYERS = [*compat.LAYER_RULES, "cute-dsl"]


@pytest.mark.parametrize("component", LAYERS)
def test_two_fingerprints_pass_a_layers_hard_rules_exactly_when_their_layer_keys_are_equal(component):
    equal_pairs = 0
    for (a_name, a), (b_name, b) in itertools.combinations(FINGERPRINTS.items(), 2):
        hard_ok = all(d.ok for d in compat.layer_decisions(component, a, b, None, None) if d.kind == compat.HARD)
        same_key = compat.layer_key(component, a, RECIPE) == compat.layer_key(component, b, RECIPE)
        assert hard_ok == same_key, (component, a_name, b_name)
        equal_pairs += same_key
    assert len({compat.layer_key(component, fp, RECIPE) for fp in FINGERPRINTS.values()}) > 1
    if component in ("triton", "flashinfer", "cuda"):
        assert equal_pairs  # some pairs share these layers: the property is tested both ways


def test_hoppers_share_the_flashinfer_and_triton_layer_keys_not_inductors():
    sxm, pcie, h200 = (FINGERPRINTS[n] for n in ("h100-sxm", "h100-pcie", "h200"))
    for other in (pcie, h200):
        for name in ("flashinfer", "triton"):
            assert compat.layer_key(name, sxm, RECIPE) == compat.layer_key(name, other, RECIPE), name
        for name in ("inductor", "vllm", "b12x"):
            assert compat.layer_key(name, sxm, RECIPE) != compat.layer_key(name, other, RECIPE), name
    assert compat.layer_key("cuda", sxm, RECIPE) == compat.layer_key("cuda", pcie, RECIPE)
    assert compat.layer_key("cuda", sxm, RECIPE) != compat.layer_key("cuda", h200, RECIPE)  # another driver
    # Each layer has its own key, and the recipe moves only the layers it enters.
    assert compat.layer_key("triton", sxm, RECIPE) != compat.layer_key("flashinfer", sxm, RECIPE)
    other = tiny_recipe(max_num_seqs=2).identity()
    assert compat.layer_key("triton", sxm, RECIPE) == compat.layer_key("triton", sxm, other)
    assert compat.layer_key("inductor", sxm, RECIPE) != compat.layer_key("inductor", sxm, other)
    assert "gpu.name" not in compat.layer_hard_fields("flashinfer", sxm)
    assert compat.layer_hard_fields("cuda", sxm)["gpu.driver"] == sxm.gpu.driver


# -- explain --------------------------------------------------------------------------------------

HELD = {"vllm": (40, 4_000), "inductor": (30, 3_000), "inductor-headers": (0, 0), "triton": (20, 2_000),
        "flashinfer": (10, 1_000), "cuda": (5, 500)}


def _entry(fp=SXM) -> IndexEntry:
    art = Artifact.new(
        key="a" * 64, recipe=RecipeRef("tiny", "0" * 64, RECIPE), fingerprint=fp,
        path_contract=PathContract(root="/cache/root", model="/models/tiny", python_prefix="/opt/venv"),
        components={n: ComponentSummary(n, (), True, files, size) for n, (files, size) in HELD.items()},
        files=[FileEntry(f"{n}/a", size, "0" * 64, 0o644, 0) for n, (files, size) in HELD.items() if files],
        timings={})
    return IndexEntry.new(art, BlobRef("b" * 64, 1), None)


def test_layer_fits_names_the_field_that_decides_each_layer():
    layers = explain.layer_fits(_entry().artifact, RECIPE, FINGERPRINTS["h100-pcie"])
    by = {layer.component: layer for layer in layers}
    assert list(by) == ["vllm", "inductor", "triton", "flashinfer", "cuda"]  # none for an empty component
    assert {n: layer.fits for n, layer in by.items()} == {"vllm": False, "inductor": False, "triton": True,
                                                         "flashinfer": True, "cuda": True}
    assert by["inductor"].line() == "inductor: NO, gpu.name: built with NVIDIA H100 80GB HBM3, this node has NVIDIA H100 PCIe"
    assert fields(by["inductor"].failed) == ["gpu.name"] and by["inductor"].bytes == 3_000
    fi = by["flashinfer"].line()
    assert fi.startswith("flashinfer: fits (decided by ") and "gpu.arch" in fi and "packages.flashinfer-python" in fi
    assert "gpu.name" not in by["flashinfer"].decided_by and "recipe" not in by["flashinfer"].decided_by
    assert "gpu.driver" in by["triton"].decided_by and "gpu.pci_device_id" not in by["triton"].decided_by
    assert by["inductor"].decided_by[-1] == "recipe"
    doc = by["inductor"].to_json()
    assert doc["component"] == "inductor" and not doc["fits"] and doc["failed"][0]["field"] == "gpu.name"
    json.dumps([layer.to_json() for layer in layers])


def test_a_candidate_that_misfits_offers_its_fitting_layers_and_explain_prints_them():
    node = FINGERPRINTS["h100-pcie"]
    entry = _entry()
    c = explain.candidate(entry, tiny_recipe(), node, compat.key(node, RECIPE))
    assert not c.accepted and c.failed_hard == ("gpu.name",)
    assert c.partial == ("triton", "flashinfer", "cuda") and c.fitting_bytes == 3_500
    doc = c.to_json()
    assert doc["partial"] == ["triton", "flashinfer", "cuda"] and len(doc["layers"]) == 5
    here = explain.candidate(entry, tiny_recipe(), SXM, compat.key(SXM, RECIPE))
    assert here.accepted and here.partial == () and all(layer.fits for layer in here.layers)
    report = cli_explain.report(explain.Explanation("tiny", "file:///store", compat.key(node, RECIPE),
                                                    node.describe(), (), (), (c,), ()))
    lines = report.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rejected"))
    layer_lines = [ln for ln in lines[start:] if ln.startswith("    layer ")]
    assert layer_lines[1] == ("    layer inductor: NO, gpu.name: built with NVIDIA H100 80GB HBM3, "
                              "this node has NVIDIA H100 PCIe")
    assert [ln.split()[1] for ln in layer_lines] == ["vllm:", "inductor:", "triton:", "flashinfer:", "cuda:"]
    assert layer_lines[3].startswith("    layer flashinfer: fits (decided by ") and "gpu.arch" in layer_lines[3]
