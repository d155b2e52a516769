"""Every shipped way onto a machine installs the warmer it came with, never a name from a package
index: no index serves a `warmer` distribution, and whoever registered the name would run code in
the build job (beside its AWS secrets), the image build, or as root on every node.

Each path's install command is taken from its shipped file as written and run here, offline,
into a fresh virtual environment: the workflow's (from a checkout of warmer's source), the
Dockerfile's (from its build context, through the bind mount it names), cloud-init's and the
systemd unit's set-up (the wheel the operator published, checked against its pinned sha256).
warmer's source is a copy of this checkout's, and the wheel is built from it."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.unit.test_manifests import _dockerfile_instructions

MANIFESTS = REPO / "manifests"
# Offline, whatever the machine's pip is set up with: no index, and the build backend (setuptools)
# taken from the environment instead of downloaded into an isolated one. pip reads
# PIP_NO_BUILD_ISOLATION inverted (pypa/pip#5735): "0" is what --no-build-isolation means.
PIP_OFFLINE = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_CONFIG_FILE": os.devnull,
               "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kw)


def copy_source(dest: Path) -> Path:
    """warmer's source as a checkout holds it; pip builds beside it (build/, *.egg-info), so never here."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    shutil.copytree(REPO / "warmer", dest / "warmer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel an operator publishes, built from this checkout's source as the README says."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp / "dist", copy_source(tmp / "src")],
              env={**os.environ, **PIP_OFFLINE})
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (tmp / "dist").glob("warmer-*.whl")
    return whl


def fresh_venv(path: Path) -> Path:
    """A virtual environment that holds nothing of warmer, with warmer's dependencies (and pip and
    setuptools) already importable: a .pth names a view of this venv's site-packages that leaves
    out warmer's own entries (its editable install). `--system-site-packages` would not do: from
    a venv's python it reaches the base interpreter's site-packages, not the venv's."""
    assert run([sys.executable, "-m", "venv", "--without-pip", path]).returncode == 0
    ours = Path(sysconfig.get_paths()["purelib"])
    view = path / "deps"
    view.mkdir()
    for entry in ours.iterdir():
        if not re.match(r"(__editable__[._]*)?warmer", entry.name, re.I):
            (view / entry.name).symlink_to(entry)
    python = path / "bin" / "python"
    purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    Path(purelib, "deps.pth").write_text(f"{view}\n")
    assert imports_warmer(python, path).returncode != 0, "the fresh venv must not see warmer yet"
    return python


def imports_warmer(python: Path, venv: Path) -> subprocess.CompletedProcess:
    """`import warmer` in that venv alone: from its own directory (not the checkout's, which
    `python -c` would put first on sys.path) and with no PYTHONPATH."""
    return run([python, "-c", "import warmer; print(warmer.__file__)"], cwd=venv, env={"PATH": "/usr/bin:/bin"})


def installed_from(python: Path, venv: Path) -> None:
    """warmer is now installed in that venv, as a copy (not the checkout's editable install), and runs."""
    out = imports_warmer(python, venv)
    assert out.returncode == 0 and Path(out.stdout.strip()).is_relative_to(venv), out.stdout + out.stderr
    version = run([venv / "bin" / "warmer", "--version"], cwd=venv, env={"PATH": "/usr/bin:/bin"})
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and expected in version.stdout + version.stderr, version.stdout + version.stderr


def shell_env(venv: Path, **extra) -> dict[str, str]:
    return {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(venv), "TMPDIR": str(venv), **PIP_OFFLINE, **extra}


# --- the CI workflow: warmer's source at a pinned commit ------------------------------------------

def _workflow() -> dict:
    return yaml.safe_load((MANIFESTS / "ci" / "github-warm-caches.yml").read_text())


def _warmer_checkouts(job: dict) -> list[dict]:
    return [s for s in job["steps"] if s.get("uses", "").startswith("actions/checkout@")
            and s.get("with", {}).get("path") == "warmer-src"]


def test_the_workflow_checks_out_warmer_at_a_pinned_commit():
    wf = _workflow()
    assert wf["env"]["WARMER_REPOSITORY"] and re.fullmatch(r"[0-9a-f]{40}", wf["env"]["WARMER_REF"]), \
        "WARMER_REF must be a full commit SHA: a tag or a branch can move"
    for name in ("plan", "gpu-accept"):
        (checkout,) = _warmer_checkouts(wf["jobs"][name])
        assert checkout["with"] == {"repository": "${{ env.WARMER_REPOSITORY }}", "ref": "${{ env.WARMER_REF }}",
                                    "path": "warmer-src", "persist-credentials": False}, name
    # gpu-accept runs warmer's own script, from that checkout: this repository's manifests/ holds none.
    (accept,) = [s for s in wf["jobs"]["gpu-accept"]["steps"] if "gpu-accept.sh" in s.get("run", "")]
    (script,) = re.findall(r"\S*gpu-accept\.sh", accept["run"])
    assert script.startswith("warmer-src/") and (REPO / script.removeprefix("warmer-src/")).is_file()
    # The build job uses the image's warmer, the one the pods fetch with: it installs none.
    assert not [s for s in wf["jobs"]["build"]["steps"] if "pip" in s.get("run", "")]


def test_the_workflow_installs_warmer_from_its_checkout(tmp_path):
    (step,) = [s for s in _workflow()["jobs"]["plan"]["steps"] if "pip install" in s.get("run", "")]
    work = tmp_path / "workspace"
    copy_source(work / "warmer-src")
    python = fresh_venv(tmp_path / "venv")
    # GitHub runs `run:` with bash -e, in the workspace, with setup-python's python first on PATH.
    out = run(["bash", "-e", "-c", step["run"]], cwd=work, env=shell_env(tmp_path / "venv"))
    assert out.returncode == 0, out.stdout + out.stderr
    installed_from(python, tmp_path / "venv")


# --- the Dockerfile: warmer's source in the build context -----------------------------------------

def _mount_options(run_line: str) -> tuple[list[dict[str, str]], str]:
    """(each --mount's options, the command after them) of a RUN instruction."""
    mounts, rest = [], run_line
    while (m := re.match(r"\s*--mount=(\S+)\s+", rest)):
        mounts.append(dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in m.group(1).split(",")))
        rest = rest[m.end():]
    return mounts, rest


def test_the_dockerfile_installs_warmer_from_its_build_context(tmp_path):
    ins = _dockerfile_instructions()
    stage = ins[:[i for i, (op, _) in enumerate(ins) if op == "FROM"][1]]  # the `warmer` stage
    (install,) = [rest for op, rest in stage if op == "RUN" and "pip install" in rest]
    args = dict(rest.split("=", 1) for op, rest in stage if op == "ARG" and "=" in rest)
    mounts, command = _mount_options(install)
    (src,) = [m for m in mounts if m.get("source") == "${WARMER_SRC}"]
    assert src["type"] == "bind" and "rw" in src and args["WARMER_SRC"]  # rw: the build writes beside it
    # The bind mount, as BuildKit makes it: the build context's WARMER_SRC at the target path.
    context = tmp_path / "context"
    copy_source(context / args["WARMER_SRC"])
    command = command.replace(src["target"], str(context / args["WARMER_SRC"]))
    python = fresh_venv(tmp_path / "venv")
    out = run(["sh", "-c", command], env=shell_env(tmp_path / "venv"))  # RUN's shell form: /bin/sh -c
    assert out.returncode == 0, out.stdout + out.stderr
    installed_from(python, tmp_path / "venv")


# --- the nodes: the published wheel, its sha256 pinned in the file --------------------------------

def _pinned(argv: list[str], wheel: Path) -> list[str]:
    """The install command with the operator's EDIT values (the wheel's URL and sha256) set to
    the wheel built here."""
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return [f"WARMER_WHEEL_URL={wheel.as_uri()}" if a.startswith("WARMER_WHEEL_URL=") else
            f"WARMER_WHEEL_SHA256={sha}" if a.startswith("WARMER_WHEEL_SHA256=") else a for a in argv]


def _run_node_install(argv: list[str], tmp_path: Path, cwd: Path | None = None):
    for tool in ("curl", "sha256sum"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is not installed here: the nodes' install script runs it")
    python = fresh_venv(tmp_path / "venv")
    (tmp_path / "bin").mkdir()
    env = shell_env(tmp_path / "venv", VLLM_PYTHON=str(python), WARMER_LINK=str(tmp_path / "bin" / "warmer"))
    return python, run(argv, cwd=cwd, env=env)


def _cloud_init_install(tmp_path: Path) -> list[str]:
    """cloud-init's runcmd entry that installs warmer, its script written where write_files puts it
    (here: under tmp_path)."""
    ci = yaml.safe_load((MANIFESTS / "node" / "cloud-init.yaml").read_text())
    files = {f["path"]: f for f in ci["write_files"]}
    (argv,) = [c for c in ci["runcmd"] if isinstance(c, list) and any(a in files for a in c)]
    script_path = next(a for a in argv if a in files)
    script = tmp_path / Path(script_path).name
    script.write_text(files[script_path]["content"])
    script.chmod(int(files[script_path]["permissions"], 8))
    return [str(script) if a == script_path else a for a in argv]


def test_cloud_init_installs_the_wheel_whose_sha256_it_pins(tmp_path, wheel):
    argv = _cloud_init_install(tmp_path)
    python, out = _run_node_install(_pinned(argv, wheel), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    installed_from(python, tmp_path / "venv")
    assert (tmp_path / "bin" / "warmer").resolve() == (tmp_path / "venv" / "bin" / "warmer").resolve()


def test_cloud_init_refuses_a_wheel_that_is_not_the_pinned_one(tmp_path, wheel):
    """With the shipped placeholder sha256 (any digest but the wheel's), nothing is installed."""
    argv = _pinned(_cloud_init_install(tmp_path), wheel)
    argv = [a if not a.startswith("WARMER_WHEEL_SHA256=") else "WARMER_WHEEL_SHA256=" + "0" * 64 for a in argv]
    python, out = _run_node_install(argv, tmp_path)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr, out.stdout + out.stderr
    assert imports_warmer(python, tmp_path / "venv").returncode != 0
    assert not (tmp_path / "bin" / "warmer").exists()


def _unit_setup_commands() -> list[str]:
    """The set-up commands in the unit's header, as an operator copies them (continuations joined)."""
    text = (MANIFESTS / "node" / "warmer-prefetch.service").read_text()
    block = text.split("by hand, as root:\n#\n", 1)[1].split("\n#\n", 1)[0]
    lines = [line.removeprefix("#").strip() for line in block.splitlines()]
    return re.sub(r"\\\n", " ", "\n".join(lines)).splitlines()


def test_the_systemd_setup_installs_the_wheel_whose_sha256_it_pins(tmp_path, wheel):
    (command,) = [c for c in _unit_setup_commands() if "install-warmer.sh" in c]
    argv = shlex.split(command, comments=True)
    assert argv[0] == "env" and any(a.startswith("WARMER_WHEEL_SHA256=") for a in argv)
    python, out = _run_node_install(_pinned(argv, wheel), tmp_path, cwd=REPO)  # paths in it are the repo's
    assert out.returncode == 0, out.stdout + out.stderr
    installed_from(python, tmp_path / "venv")


# --- no shipped file names warmer for an index to resolve ------------------------------------------

_VERSIONED = re.compile(r"(?<![\w./-])[\"']?warmer\s*(\[[^\]]*\])?\s*(===|==|~=|>=|<=|!=|>|<)")
_PIP_INSTALL = re.compile(r"pip3?[\"',\s]+install\b(.*)")


def index_installs(text: str) -> list[str]:
    """Lines that would have pip (or anything reading a requirement) take warmer from an index: a
    versioned requirement anywhere (`warmer==0.1.0`, as an env value or ARG too), or a bare
    `warmer` argument of `pip install`. Paths (./warmer-src, /tmp/x/warmer-0.1.0-...whl) are fine."""
    out = []
    for line in text.splitlines():
        if _VERSIONED.search(line):
            out.append(line.strip())
        elif (m := _PIP_INSTALL.search(line)):
            words = re.split(r"[\s,\[\]]+", re.split(r"&&|\|\||[;|#]", m.group(1))[0])  # this command only
            if any(re.fullmatch(r"[\"']?warmer(\[[^\]]*\])?[\"']?", w) for w in words):
                out.append(line.strip())
    return out


def test_index_installs_finds_what_was_shipped_before():
    for bad in ('RUN python3 -m pip install --no-cache-dir "warmer==${WARMER_VERSION}" && warmer --version',
                "  WARMER_PIP: warmer==0.1.0             # EDIT",
                '  - [/opt/vllm/bin/python, -m, pip, install, --no-cache-dir, "warmer==0.1.0"]',
                "pip install warmer", "pip install -U 'warmer[s3]'", "uv pip install warmer>=0.1"):
        assert index_installs(bad), bad
    for good in ("python -m pip install ./warmer-src", "python3 -m pip install --no-cache-dir /tmp/warmer-src",
                 '"$python" -m pip install --no-cache-dir "$dir/$name"', "pip install -e '.[cpu,jit,test]'",
                 "warmer fetch --all /etc/warmer", "python -m pip wheel --no-deps -w dist ./warmer-src"):
        assert not index_installs(good), good


def _shipped() -> list[Path]:
    return [p for p in sorted(MANIFESTS.rglob("*")) if p.is_file()]


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: p.relative_to(MANIFESTS).as_posix())
def test_no_shipped_file_installs_warmer_from_an_index(path):
    assert index_installs(path.read_text()) == []


def test_the_readme_installs_warmer_from_no_index():
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Where it runs\n", 1)[1].split("\n## ", 1)[0]
    assert index_installs(section) == []
