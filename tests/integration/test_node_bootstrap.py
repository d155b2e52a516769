"""Node bootstrap at the node: `warmer fetch --all` against a real S3 API (moto on loopback), and the
systemd unit and the prefetch DaemonSet that run it, with their commands run as they are written."""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_warmer, time_cap
from tests.fixtures import nodes
from warmer import build, fingerprint, restore
from warmer.fleet import fetch_all, write_metrics
from warmer.recipe import parse
from warmer.store import open_store

MANIFESTS = REPO / "manifests"
SKUS = """
[defaults]
image = "registry.example.com/vllm-warmer:v0.32.0"
[sku.cpu-x86_64]
runs_on = ["ubuntu-latest"]
node_selector = { "kubernetes.io/arch" = "amd64" }
[sku.h200]
gpu_name = "NVIDIA H200"
runs_on = ["self-hosted", "gpu-h200"]
node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H200" }
"""
# Three recipes; this (CPU, x86_64) node's SKU is cpu-x86_64: two of them are its.
RECIPES = {"alpha": ["cpu-x86_64"], "beta": ["cpu-x86_64", "h200"], "gamma": ["h200"]}


def _recipe_text(name: str, targets: list[str]) -> str:
    return (f'name = "{name}"\ntargets = {json.dumps(targets)}\n[model]\npath = "/models/{name}"\n'
            '[engine]\nmax_num_seqs = 4\nmax_num_batched_tokens = 128\n[workload]\nprompt_lengths = [8]\n')


@pytest.fixture
def fleet(tmp_path, packed, s3_url):
    if os.uname().machine != "x86_64":
        pytest.skip("the fixture's CPU SKU is x86_64")
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True)
    (manifests / "skus.toml").write_text(SKUS)
    store = open_store(s3_url)
    for name, targets in RECIPES.items():
        path = manifests / "models" / f"{name}.toml"
        path.write_text(_recipe_text(name, targets))
        recipe = parse(tomllib.loads(path.read_text()), path)
        build.publish(store, packed(name, recipe=recipe).path)
    return manifests, s3_url


def _prom(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_fetch_all_takes_the_recipes_of_this_nodes_sku(fleet, tmp_path):
    manifests, store = fleet
    base, metrics = tmp_path / "cache", tmp_path / "textfile" / "warmer.prom"
    metrics.parent.mkdir()
    out = run_warmer("fetch", "--all", manifests, "--store", store, "--root-base", base, "--metrics-file", metrics,
                     "--json")
    assert out.returncode == 0, out.stderr
    got = {o["recipe"]: o for o in json.loads(out.stdout)}
    assert {n: o["status"] for n, o in got.items()} == {"alpha": "hit", "beta": "hit", "gamma": "skipped"}
    assert "this node is cpu-x86_64" in got["gamma"]["why"]
    assert restore.active(base / "alpha").artifact.recipe.name == "alpha" and not (base / "gamma").exists()
    assert [ln.split(": ")[2].split()[0] for ln in out.stderr.splitlines() if ln.startswith("warmer fetch --all")] \
        == ["hit", "hit", "skipped"]
    prom = _prom(metrics.read_text())
    assert prom['warmer_fetch_status{recipe="alpha",status="hit"}'] == 1
    assert prom['warmer_fetch_status{recipe="alpha",status="miss"}'] == 0
    assert prom['warmer_artifact_bytes{recipe="beta"}'] == restore.active(base / "beta").artifact.total_bytes > 0
    assert prom['warmer_fetch_seconds{recipe="alpha"}'] > 0 and not [k for k in prom if "gamma" in k]
    again = json.loads(run_warmer("fetch", "--all", manifests, "--store", store, "--root-base", base, "--json").stdout)
    assert {o["recipe"]: o["status"] for o in again} == {"alpha": "already-active", "beta": "already-active",
                                                         "gamma": "skipped"}
    listed = json.loads(run_warmer("ls", "--root-base", base, "--json").stdout)
    assert [(r["recipe"], r["fits"]) for r in listed] == [("alpha", True), ("beta", True)]
    # beta retired from the manifests: its root (and its disk) stays, said, never removed under a pod.
    (manifests / "models" / "beta.toml").unlink()
    (base / "scratch").mkdir()  # not a root of warmer's: not named
    out = run_warmer("fetch", "--all", manifests, "--store", store, "--root-base", base, "--json")
    assert {o["recipe"]: o["status"] for o in json.loads(out.stdout)} == {
        "alpha": "already-active", "gamma": "skipped", "beta": "skipped"}
    assert f"beta: skipped (no manifest names it any more: its root stays (" in out.stderr, out.stderr
    assert f"`rm -rf {base / 'beta'}`" in out.stderr and restore.active(base / "beta") is not None
    # A recipe file that cannot be read (alpha's, under another file name) may be any recipe's:
    # no root is called retired, alpha's least of all.
    (manifests / "models" / "alpha.toml").rename(manifests / "models" / "first.toml")
    (manifests / "models" / "first.toml").write_text("name = \"alpha\"\ntargets = [")
    out = run_warmer("fetch", "--all", manifests, "--store", store, "--root-base", base)
    assert "first: bad-recipe" in out.stderr and "no manifest names it" not in out.stderr, out.stderr


def test_a_miss_among_them_is_a_slow_start_unless_required(fleet, tmp_path):
    manifests, store = fleet
    (manifests / "models" / "delta.toml").write_text(_recipe_text("delta", ["cpu-x86_64"]))  # never published
    args = ["fetch", "--all", manifests, "--store", store, "--root-base", tmp_path / "cache"]
    out = run_warmer(*args)
    assert out.returncode == 0 and "delta: miss" in out.stderr and "alpha: hit" in out.stderr
    assert run_warmer(*args, "--require").returncode == 3


def test_one_bad_recipe_file_never_stops_the_others(fleet, tmp_path):
    """On a DaemonSet, a broken file in the recipes' ConfigMap must not turn every recipe cold."""
    manifests, store = fleet
    models = manifests / "models"
    (models / "broken.toml").write_text("name = [unclosed\n")                       # invalid TOML
    (tmp_path / "outside.toml").write_text(_recipe_text("outside", ["cpu-x86_64"]))
    (models / "elsewhere.toml").symlink_to(tmp_path / "outside.toml")                 # a link out of the directory
    with open(models / "huge.toml", "wb") as f:                                       # 100 MB (sparse)
        f.truncate(100 << 20)
    (models / "escape.toml").write_text(_recipe_text("../x", ["cpu-x86_64"]))         # a name that is a path
    os.mkfifo(models / "fifo.toml")                                                   # would hang a reader
    # A ConfigMap volume's files are links into its own ..data directory: those are fine.
    (models / "..2026_12_04").mkdir()
    (models / "..2026_12_04" / "delta.toml").write_text(_recipe_text("delta", ["cpu-x86_64"]))
    (models / "delta.toml").symlink_to("..2026_12_04/delta.toml")
    base, metrics = tmp_path / "cache", tmp_path / "warmer.prom"
    with time_cap(120):
        out = run_warmer("fetch", "--all", manifests, "--store", store, "--root-base", base, "--metrics-file",
                         metrics, "--json")
    assert out.returncode == 2, out.stderr  # the others were fetched; the bad files are the operator's to fix
    got = {o["recipe"]: o["status"] for o in json.loads(out.stdout)}
    bad = ("broken", "elsewhere", "huge", "escape", "fifo")
    assert got == {"alpha": "hit", "beta": "hit", "gamma": "skipped", "delta": "miss", **dict.fromkeys(bad, "bad-recipe")}
    lines = [ln for ln in out.stderr.splitlines() if ": bad-recipe, not fetched: " in ln]
    assert len(lines) == len(bad) and any("outside" in ln and "refused" in ln for ln in lines), lines
    prom = _prom(metrics.read_text())
    assert all(prom[f'warmer_fetch_status{{recipe="{name}",status="bad-recipe"}}'] == 1 for name in bad)
    assert prom['warmer_fetch_status{recipe="alpha",status="hit"}'] == 1


def _shipped_manifests(tmp_path: Path) -> Path:
    """manifests/ as an operator copies it: the catalogue and the recipes, nothing edited."""
    manifests = tmp_path / "manifests"
    shutil.copytree(MANIFESTS / "models", manifests / "models")
    shutil.copy(MANIFESTS / "skus.toml", manifests / "skus.toml")
    return manifests


@pytest.mark.parametrize("node", ["cpu:amd-genoa", "cpu:aws-graviton3", "gpu:h200", "gpu:rtx-5090"])
def test_the_shipped_recipes_never_make_a_bad_round_where_their_env_is_not_set(tmp_path, monkeypatch, node):
    """The tiny demo and acceptance recipes' model is ${WARMER_TINY_MODEL}, which no node sets: they
    target no SKU, so fetch --all skips them (as `warmer matrix` does) before anything expands it,
    and the systemd unit and the DaemonSet end each round with exit 0, never bad-recipe."""
    monkeypatch.delenv("WARMER_TINY_MODEL", raising=False)
    kind, name = node.split(":")
    fake = nodes.cpu_node(name) if kind == "cpu" else nodes.gpu_node(name)
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: fake)
    manifests = _shipped_manifests(tmp_path)
    outcomes = fetch_all(manifests, f"file://{tmp_path / 'store'}", tmp_path / "cache")
    got = {o.recipe: o for o in outcomes}
    assert not [o.line() for o in outcomes if o.bad_recipe]
    tiny = sorted(n for n in got if n.startswith("tiny-"))
    assert tiny == ["tiny-llama-cpu", "tiny-llama-gpu", "tiny-qwen3-moe-gpu"]
    assert all(got[n].status == "skipped" and got[n].why_skipped.startswith("targets no SKU;") for n in tiny)
    write_metrics(tmp_path / "warmer.prom", outcomes)
    assert "bad-recipe\"} 1" not in (tmp_path / "warmer.prom").read_text()
    # This node's own recipe (an empty store: a miss) still goes through fetch.
    mine = {"gpu:h200": "llama-3.1-8b-h200", "gpu:rtx-5090": "qwen3.6-27b-nvfp4-sm120"}.get(node)
    assert {n for n, o in got.items() if o.status != "skipped"} == ({mine} if mine else set())
    if mine:
        assert got[mine].status == "miss"


def test_the_shipped_manifests_exit_0_from_the_cli_without_their_env(tmp_path):
    """The command the systemd unit and the DaemonSet run, on this machine, with no WARMER_TINY_MODEL."""
    manifests = _shipped_manifests(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "WARMER_TINY_MODEL"}
    out = run_warmer("fetch", "--all", manifests, "--store", f"file://{tmp_path / 'store'}", "--root-base",
                     tmp_path / "cache", "--json", env=env)
    assert out.returncode == 0, out.stderr
    got = {o["recipe"]: o for o in json.loads(out.stdout)}
    assert "bad-recipe" not in {o["status"] for o in got.values()}, out.stderr
    assert got["tiny-llama-cpu"]["status"] == "skipped" and "targets no SKU" in got["tiny-llama-cpu"]["why"]


def test_a_recipe_for_this_node_with_an_unset_variable_is_still_a_bad_recipe(tmp_path, monkeypatch):
    """Skipping before expanding is for other SKUs' recipes only: this node's recipe that cannot
    expand is the operator's error, said with the variable's name, and the others still run."""
    monkeypatch.delenv("WARMER_TEST_UNSET_MODEL", raising=False)
    monkeypatch.setattr(fingerprint, "probe", lambda **kw: nodes.cpu_node("amd-genoa"))  # cpu-x86_64
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True)
    (manifests / "skus.toml").write_text(SKUS)
    for name, targets in {"mine": ["cpu-x86_64"], "theirs": ["h200"], "fine": ["cpu-x86_64"]}.items():
        text = _recipe_text(name, targets)
        if name != "fine":
            text = text.replace(f'"/models/{name}"', '"${WARMER_TEST_UNSET_MODEL}"')
        (manifests / "models" / f"{name}.toml").write_text(text)
    got = {o.recipe: o for o in fetch_all(manifests, f"file://{tmp_path / 'store'}", tmp_path / "cache")}
    assert {n: o.status for n, o in got.items()} == {"mine": "bad-recipe", "theirs": "skipped", "fine": "miss"}
    assert "${WARMER_TEST_UNSET_MODEL}" in got["mine"].bad_recipe and "not set" in got["mine"].bad_recipe
    assert "mine.toml" in got["mine"].bad_recipe and "this node is cpu-x86_64" in got["theirs"].why_skipped


def _exec_start(unit: Path) -> list[str]:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read_string(unit.read_text())
    return shlex.split(parser["Service"]["ExecStart"])


def test_the_systemd_unit_runs_fetch_all_and_a_miss_never_fails_the_boot(fleet, tmp_path):
    manifests, store = fleet
    unit = MANIFESTS / "node" / "warmer-prefetch.service"
    argv = _exec_start(unit)
    assert argv[:3] == ["/usr/local/bin/warmer", "fetch", "--all"]
    text = unit.read_text()
    assert "SuccessExitStatus=0 3" in text and "Before=vllm.service" in text and "EnvironmentFile=-" in text
    assert "OnUnitActiveSec" in (MANIFESTS / "node" / "warmer-prefetch.timer").read_text()
    # The unit's command, its paths moved under tmp_path, run with the store from the env file.
    metrics = tmp_path / "warmer.prom"
    moved = {"/etc/warmer": str(manifests), "/cache": str(tmp_path / "cache"),
             "/var/lib/node_exporter/textfile_collector/warmer.prom": str(metrics)}
    out = run_warmer(*[moved.get(a, a) for a in argv[1:]], env={**os.environ, "WARMER_STORE": store})
    assert out.returncode == 0, out.stderr
    assert "alpha: hit" in out.stderr and "gamma: skipped" in out.stderr and metrics.exists()
    # A store that cannot be reached: still exit 0, the boot goes on.
    down = run_warmer(*[moved.get(a, a) for a in argv[1:]], env={**os.environ, "WARMER_STORE": "s3://no-such-bucket-x"})
    assert down.returncode == 0 and "Traceback" not in down.stderr


def test_the_prefetch_daemonset_fills_the_hostpath_the_pods_read(fleet, tmp_path):
    manifests, store = fleet
    ds = yaml.safe_load((MANIFESTS / "k8s" / "warmer-prefetch-daemonset.yaml").read_text())
    assert ds["kind"] == "DaemonSet"
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    deployment = next(d for d in yaml.safe_load_all((MANIFESTS / "k8s" / "vllm-deployment.yaml").read_text())
                      if d["kind"] == "Deployment")
    pod_volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/cache"]]["hostPath"]["path"] == pod_volumes["cache"]["hostPath"]["path"]
    assert "configMap" in volumes[mounts["/etc/warmer/models"]]
    assert "nvidia.com/gpu" not in str(c.get("resources"))  # takes no GPU from vLLM
    # The loop's fetch, its paths moved under tmp_path, run once.
    (line,) = [ln.strip() for ln in c["args"][0].splitlines() if ln.strip().startswith("warmer fetch")]
    argv = shlex.split(line)
    moved = {"/etc/warmer": str(manifests), "/cache": str(tmp_path / "cache"),
             "/metrics/warmer.prom": str(tmp_path / "warmer.prom")}
    out = run_warmer(*[moved.get(a, a) for a in argv[1:]], "--store", store)
    assert out.returncode == 0 and "alpha: hit" in out.stderr and "beta: hit" in out.stderr
