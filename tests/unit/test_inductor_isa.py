"""A real Inductor CPU cache, built here by torch.compile, is refused where the CPU's ISA differs.

Inductor does not key its CPU cache on the instruction set (an AVX-512 cache reused on AVX2 gave
wrong numbers, the reverse crashed: research/torch-inductor-triton-caches.md), so warmer must.
"""

import importlib.util
import os

import pytest

from tests.conftest import run_python, tiny_recipe
from tests.fixtures import nodes
from warmer import build, explain, fetch, fingerprint, restore
from warmer.store import open_store

# torch runs in a child process only: this one stays as light as a node.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch (the cpu extra) is not installed")

COMPILE = """
import torch
def f(x):
    return torch.relu(x.sin() * 2 + x.cos())
torch.manual_seed(0)
x = torch.randn(64)
# a vectorized sin/cos differs from eager's by an ulp or two: near relu's 0 that is over the default atol
assert torch.allclose(torch.compile(f)(x), f(x), atol=1e-6)
"""


@pytest.fixture(scope="module")
def inductor_root(tmp_path_factory):
    """A root whose inductor/ holds what a cold torch.compile left: FX graphs and C++ kernels."""
    base = tmp_path_factory.mktemp("inductor")
    root, scratch = base / "root", base / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TMPDIR": str(scratch),
           # the 150 MB precompiled header costs ~8 s here and is not what this test is about
           "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
           # in process, as vLLM's CPU platform compiles: no pool of compile-worker processes
           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    run_python("-c", COMPILE, env=env, timeout=300)
    kernels = sorted(p.relative_to(root).as_posix() for p in (root / "inductor").rglob("*.so"))
    assert kernels, "torch.compile left no C++ kernel"
    return root, kernels


def _other_isa(isa: list[str]) -> list[str]:
    """This CPU's ISA with AVX-512 taken away (or, on an AVX2 CPU, added)."""
    if "avx512f" in isa:
        return [f for f in isa if not f.startswith(("avx512", "amx"))]
    return sorted(isa + ["avx512f", "avx512bw", "avx512dq", "avx512vl"])


def test_fetch_refuses_a_real_inductor_cache_for_another_isa(inductor_root, tmp_path, monkeypatch):
    root, kernels = inductor_root
    recipe = tiny_recipe()
    built = fingerprint.probe(root=root, model=recipe.model)
    art = tmp_path / "inductor.tar.zst"
    doc = build.pack_root(root, recipe, art, fp=built)
    assert set(kernels) <= {f.path for f in doc.files}
    store = open_store(f"file://{tmp_path / 'store'}")
    assert build.publish(store, art).status == "published"

    other = nodes.edit(built, **{"cpu.isa": _other_isa(list(built.cpu.isa))})
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: other)
    node_root = tmp_path / "node"
    got = fetch.fetch(recipe, store.url, node_root).to_json()
    assert got["status"] in ("miss", "misfit") and "restore" not in got
    assert [p.name for p in node_root.rglob("*") if p.is_file()] == [restore.PREPARED]
    assert restore.active(node_root) is None
    [difference] = got["nearest"]["differences"]
    assert difference.startswith("cpu.isa: ") and "avx512f" in difference
    [candidate] = explain.explain(store, recipe, other).to_json()["candidates"]
    assert not candidate["accepted"] and candidate["failed"] == {"hard": ["cpu.isa"], "ranged": []}
    isa = next(d for d in candidate["decisions"] if d["field"] == "cpu.isa")
    assert "wrong numbers" in isa["why"]

    # The same fingerprint is accepted, and the kernels arrive byte for byte.
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: built)
    got = fetch.fetch(recipe, store.url, node_root)
    assert got.status == "hit", got.warnings
    for rel in kernels:
        assert (node_root / rel).read_bytes() == (root / rel).read_bytes()
    assert explain.explain(store, recipe, built).candidates[0].accepted
