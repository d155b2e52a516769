"""`warmer fetch --all` when one target cannot be fetched as given (its root is not a directory, its
name is another file's too): that target's outcome, said by name, never the others'."""

from __future__ import annotations

import json
import os
import tomllib

import pytest

from tests.conftest import run_warmer
from tests.integration.test_node_bootstrap import SKUS  # a CPU SKU this x86_64 node is, and a GPU one
from warmer import build, fingerprint, fleet, restore
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


def test_a_bad_file_of_a_fetched_recipes_name_gives_one_outcome_per_name(tmp_path):
    """alpha.toml and alpha-old.toml both named alpha, the old one unusable here (a key this version
    refuses): alpha was fetched and also bad-recipe, so the metrics held alpha's series twice and
    node_exporter refused the whole file, every recipe's metrics with it. One outcome per name."""
    if os.uname().machine != "x86_64":
        pytest.skip("the catalogue's CPU SKU is x86_64")
    (tmp_path / "models").mkdir()
    (tmp_path / "skus.toml").write_text(SKUS)
    body = '[model]\npath = "/models/a"\n[engine]\nmax_num_seqs = 4\n[workload]\nprompt_lengths = [8]\n'
    (tmp_path / "models" / "alpha.toml").write_text('name = "alpha"\ntargets = ["cpu-x86_64"]\n' + body)
    (tmp_path / "models" / "alpha-old.toml").write_text('name = "alpha"\ntargets = ["cpu-x86_64"]\nold = 1\n' + body)
    (tmp_path / "models" / "beta.toml").write_text('name = "beta"\ntargets = ["cpu-x86_64"]\n' + body)
    chosen, _, bad = fleet.recipes_for_node(tmp_path, fingerprint.probe())
    assert [r.name for r in chosen] == ["beta"] and [name for name, _ in bad] == ["alpha"]
    assert "alpha-old.toml" in bad[0][1] and "alpha.toml is named 'alpha'" in bad[0][1]
    outcomes = [fleet.Outcome(name, f"/cache/{name}", None, 0.0, bad_recipe=why) for name, why in bad]
    series = [ln.split(" ")[0] for ln in fleet.metrics(outcomes).splitlines() if not ln.startswith("#")]
    assert len(series) == len(set(series))


def test_a_folder_under_the_root_base_this_user_cannot_enter_is_no_retired_root(tmp_path, monkeypatch):
    """lost+found (root's, 0700) at the top of an ext4 disk mounted as the root base, read by the
    pods' user: not a root of warmer's, and no reason to fail the round. The suite runs as root, which
    every folder lets in: the EACCES that user gets stands in."""
    from pathlib import Path
    (tmp_path / "lost+found").mkdir()
    restore.prepare(tmp_path / "old-model")
    real = Path.is_file

    def refused(self):
        if self.parent.name == "lost+found":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", refused)
    assert [o.recipe for o in fleet._unlisted(tmp_path, set())] == ["old-model"]


def _families(text: str) -> dict:
    """The metrics as Prometheus's own client library parses the text format: {name: family}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_metrics_read_as_prometheus_reads_them_and_a_failed_run_replaces_them(tmp_path, packed):
    """Each family's lines together, typed (the samples of the three families came interleaved: a
    parser that is not node_exporter's lost their types); then a run that fails as a whole (a broken
    skus.toml, a probe past the deadline) left the last run's `hit` in place, every dashboard green
    on a node that no longer fetched: it says the run failed, and no recipe's outcome."""
    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha", "beta": "beta"})
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics)
    assert out.returncode == 0, out.stderr
    families = _families(metrics.read_text())
    assert all(f.type == "gauge" and f.documentation for f in families.values()), families
    assert [s.value for s in families["warmer_fetch_run_success"].samples] == [1]
    held = {s.labels["recipe"]: s.value for s in families["warmer_artifact_bytes"].samples}
    assert held == {n: restore.active(base / n).bytes_held for n in ("alpha", "beta")} and all(held.values())
    hits = {s.labels["recipe"] for s in families["warmer_fetch_status"].samples if s.value and s.labels["status"] == "hit"}
    assert hits == {"alpha", "beta"}

    (manifests / "skus.toml").write_text((manifests / "skus.toml").read_text() + "\n[sku.broken\n")
    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics)
    assert out.returncode == 2, out.stderr
    families = _families(metrics.read_text())
    assert [s.value for s in families["warmer_fetch_run_success"].samples] == [0]
    assert not families["warmer_fetch_status"].samples and not families["warmer_artifact_bytes"].samples

    # and whatever else stops a run once its metrics file is known: a typo in WARMER_REQUIRE, say
    (manifests / "skus.toml").write_text(SKUS)
    args = ("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file", metrics)
    assert run_warmer(*args).returncode == 0
    assert [s.value for s in _families(metrics.read_text())["warmer_fetch_run_success"].samples] == [1]
    out = run_warmer(*args, env={**os.environ, "WARMER_REQUIRE": "flashinfer,trition"})
    assert out.returncode == 2 and "trition is not a cache component" in out.stderr, out.stderr
    assert [s.value for s in _families(metrics.read_text())["warmer_fetch_run_success"].samples] == [0]


def test_the_bytes_reported_are_those_vllm_is_pointed_at(tmp_path, packed):
    """A root holding an artifact the run refused (unsigned, where keys are trusted): vLLM is
    pointed at a cold directory, and the metrics counted the held artifact's bytes all the same."""
    from tests.unit.test_signing import _keypair

    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha"})
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    assert run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base).returncode == 0
    _, public = _keypair(tmp_path, "builder")
    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics, "--trusted-key", public, "--json")
    assert [o["status"] for o in json.loads(out.stdout)] == ["untrusted"], out.stderr
    families = _families(metrics.read_text())
    assert [(s.labels["recipe"], s.value) for s in families["warmer_artifact_bytes"].samples] == [("alpha", 0)]
    assert restore.active(base / "alpha") is not None  # held, and left as it is


def test_a_recipe_file_name_that_is_not_utf8_is_said_in_the_metrics_not_a_crash(tmp_path, packed):
    """A bad recipe is named by its file's stem; one that is not UTF-8 (a systemd node's
    /etc/warmer/models) crashed the metrics write after every fetch: exit 1, the outcomes lost."""
    manifests, store = _manifests(tmp_path, packed, {"alpha": "alpha"})
    (manifests / "models" / os.fsdecode(b"b\xffd.toml")).write_text("name = [\n")
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    out = run_warmer("fetch", "--all", manifests, "--store", store.url, "--root-base", base, "--metrics-file",
                     metrics, "--json")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    families = _families(metrics.read_text())
    bad = [s.labels["recipe"] for s in families["warmer_fetch_status"].samples
           if s.labels["status"] == "bad-recipe" and s.value]
    assert bad == ["b\\udcffd"]
