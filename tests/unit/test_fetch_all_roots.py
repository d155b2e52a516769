"""`warmer fetch --all` when one target cannot be fetched as given (its root is not a directory, its
name is another file's too): that target's outcome, said by name, never the others'."""

from __future__ import annotations

import json
import os
import tomllib

import pytest

from tests.conftest import run_warmer
from tests.integration.test_node_bootstrap import SKUS  # a CPU SKU this x86_64 node is, and a GPU one
from warmer import build, restore
from warmer.recipe import parse
from warmer.store import open_store


def _manifests(tmp_path, packed, files: dict[str, str], seqs: int = 4):
    """manifests/ with models/FILE.toml named NAME for this (x86_64 CPU) node's SKU, each published."""
    if os.uname().machine != "x86_64":
        pytest.skip("the catalogue's CPU SKU is x86_64")
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True, exist_ok=True)
    (manifests / "skus.toml").write_text(SKUS)
    store = open_store(f"file://{tmp_path / 'store'}")
    for file, name in files.items():
        path = manifests / "models" / f"{file}.toml"
        path.write_text(f'name = "{name}"\ntargets = ["cpu-x86_64"]\n[model]\npath = "/models/{name}"\n[engine]\n'
                        f"max_num_seqs = {seqs}\nmax_num_batched_tokens = 128\n[workload]\nprompt_lengths = [8]\n")
        build.publish(store, packed(file, recipe=parse(tomllib.loads(path.read_text()), path)).path)
        seqs += 1  # each file another recipe (another key)
    return manifests, store


def test_a_root_that_cannot_be_one_never_stops_the_other_recipes(tmp_path, packed):
    """An operator linked /cache/alpha to a bigger disk (a root must be its real path): alpha is
    refused by name, and beta and gamma are still fetched, reported and in the metrics."""
    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha", "beta": "beta", "gamma": "gamma"})
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    base.mkdir()
    (tmp_path / "disk" / "alpha").mkdir(parents=True)
    (base / "alpha").symlink_to(tmp_path / "disk" / "alpha")

    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics, "--json")
    assert out.returncode == 2, out.stderr  # the operator's to fix; the others were fetched
    got = {o["recipe"]: o for o in json.loads(out.stdout)}
    assert {n: o["status"] for n, o in got.items()} == {"alpha": "bad-root", "beta": "hit", "gamma": "hit"}
    assert "is a symlink" in got["alpha"]["why"]
    assert restore.active(base / "beta") is not None and restore.active(base / "gamma") is not None
    assert any(ln.startswith("warmer fetch --all: alpha: bad-root, not fetched: root ") for ln in out.stderr.splitlines())
    assert 'warmer_fetch_status{recipe="alpha",status="bad-root"} 1' in metrics.read_text()
    assert 'warmer_fetch_status{recipe="beta",status="hit"} 1' in metrics.read_text()


def test_two_files_of_one_name_are_refused_not_swapped_in_turn(tmp_path, packed):
    """alpha.toml and alpha-v2.toml both named alpha (an old and a new version left in a ConfigMap):
    both went into /cache/alpha, each round restoring one over the other and saying "hit" twice, and
    the name's metrics came twice (node_exporter refuses such a file). Refused by name, as `warmer
    matrix` refuses them; the others are fetched."""
    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha", "alpha-v2": "alpha", "beta": "beta"})
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics, "--json")
    assert out.returncode == 2, out.stderr
    got = json.loads(out.stdout)
    assert [(o["recipe"], o["status"]) for o in got] == [("beta", "hit"), ("alpha", "bad-recipe")]
    assert "alpha-v2.toml" in got[1]["why"] and "must be unique" in got[1]["why"]
    assert not (base / "alpha").exists()
    lines = [ln for ln in metrics.read_text().splitlines() if ln.startswith("warmer_fetch_seconds")]
    assert len(lines) == len(set(ln.split(" ")[0] for ln in lines)) == 2  # one series per recipe


def test_a_metrics_file_that_cannot_be_written_is_said_before_anything_is_fetched(tmp_path, packed):
    """node_exporter's textfile directory not mounted into the pod: found after the fetch, the
    write failed the pod (exit 1) that the fetch had just warmed, and --all's JSON was lost. A usage
    error before anything is fetched, for one recipe and for --all."""
    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha"})
    missing = tmp_path / "textfile" / "warmer.prom"
    base = tmp_path / "cache"
    every = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                       missing, "--json")
    one = run_warmer("fetch", manifests / "models" / "alpha.toml", "--store", store.url, "--root", base / "alpha",
                     "--metrics-file", missing)
    for out in (every, one):
        assert out.returncode == 2 and f"--metrics-file {missing}: " in out.stderr, out.stderr
    assert json.loads(every.stdout)["kind"] == "usage"
    assert not base.exists()  # nothing fetched
