"""The init container of manifests/k8s/ as written, run against a real S3 API (moto's server).

Its command comes from the Deployment, expanded as the kubelet would, with the bucket and the
volume mount paths swapped for this test's; then the vLLM container's own script runs with a
stand-in `vllm` that records the env and arguments it was started with.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, make_cache_tree
from tests.unit.test_manifests import command_of, container_env, init_container, pod_spec
from warmer import build, components, restore
from warmer.recipe import load
from warmer.store import open_store

MODELS = REPO / "manifests" / "models"


class Pod:
    """The Deployment's pod on this machine: each volume mount path maps to a directory here."""

    def __init__(self, tmp_path: Path, s3_url: str):
        self.deployment, self.init = init_container()
        self.spec = pod_spec(self.deployment)
        (self.vllm,) = [c for c in self.spec["containers"] if c["name"] == "vllm"]
        self.mounts: dict[str, Path] = {}
        for c in (self.init, self.vllm):
            for m in c["volumeMounts"]:
                self.mounts.setdefault(m["mountPath"], tmp_path / "pod" / m["name"])
        for d in self.mounts.values():
            d.mkdir(parents=True, exist_ok=True)
        # The ConfigMap `kubectl create configmap --from-file=manifests/models/` makes.
        recipes = next(m for m in self.init["volumeMounts"] if "configMap" in self._volume(m["name"]))
        for f in MODELS.glob("*.toml"):
            shutil.copy(f, self.mounts[recipes["mountPath"]] / f.name)
        self.recipe_name = container_env(self.init)["WARMER_RECIPE"]
        self.argv = [self.local(a) for a in command_of(self.init, WARMER_STORE=s3_url)]
        self.env_file = Path(self.argv[self.argv.index("--env-file") + 1])
        self.root = Path(self.argv[self.argv.index("--root") + 1])
        self.bin = tmp_path / "bin"

    def _volume(self, name: str) -> dict:
        return next(v for v in self.spec["volumes"] if v["name"] == name)

    def local(self, text: str) -> str:
        """A path in the pod (an argv element) as its directory here: the longest mount it is under."""
        for mount in sorted(self.mounts, key=len, reverse=True):
            if text == mount:
                return str(self.mounts[mount])
            if text.startswith(mount + "/"):
                return f"{self.mounts[mount]}/{text[len(mount) + 1:]}"
        return text

    def run_init(self) -> subprocess.CompletedProcess:
        env = {**os.environ, **container_env(self.init),
               # The image's PATH: warmer's console script beside this Python.
               "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        env["WARMER_STORE"] = self.argv[self.argv.index("--store") + 1]
        assert shutil.which(self.argv[0], path=env["PATH"]), f"{self.argv[0]} is not on the image's PATH"
        return subprocess.run(self.argv, capture_output=True, text=True, env=env, timeout=300)

    def run_vllm(self) -> tuple[subprocess.CompletedProcess, dict[str, str], list[str]]:
        """The vLLM container's command (`warmer serve`), as a dry run: (result, the env vLLM would
        start with, the command it would exec). The dry run is what the real start would exec."""
        argv = [self.local(a) for a in command_of(self.vllm)]
        assert argv[:2] == ["warmer", "serve"], argv
        cut = argv.index("--") if "--" in argv else len(argv)
        argv = argv[:cut] + ["--dry-run", "--json"] + argv[cut:]
        # A pod's env: no AWS credentials, no test runner variables; the image's PATH.
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/root",
               "HOSTNAME": "vllm-llama-3-1-8b-7d9f8-x2x7q"}
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        plan = json.loads(out.stdout) if out.returncode == 0 else {"env": {}, "command": []}
        return out, {**env, **plan["env"]}, plan["command"]


def sourced(env_file: Path) -> dict[str, str]:
    """What `set -a; . FILE` gives a POSIX shell: the env file must be sourceable by sh."""
    out = subprocess.run(["sh", "-c", 'set -a; . "$1"; env', "sh", str(env_file)], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def publish_for_this_node(s3_url: str, recipe_name: str, tmp_path: Path) -> build.PublishResult:
    """The CI build's output for this node's fingerprint: a cache tree packed and published."""
    src = tmp_path / "ci-root"
    make_cache_tree(src)
    art = tmp_path / "ci" / f"{recipe_name}.tar.zst"
    build.pack_root(src, load(MODELS / f"{recipe_name}.toml"), art, timings={"build": {"init_engine_s": 95.0}})
    return build.publish(open_store(s3_url), art)


def test_init_container_hit_leaves_a_usable_env_file_and_vllm_starts_warm(s3_url, tmp_path):
    pod = Pod(tmp_path, s3_url)
    assert pod.argv[:2] == ["warmer", "fetch"] and pod.argv[pod.argv.index("--store") + 1] == s3_url
    published = publish_for_this_node(s3_url, pod.recipe_name, tmp_path)
    assert published.status == "published"

    out = pod.run_init()
    assert out.returncode == 0, out.stderr
    assert "warmer fetch: hit" in out.stderr, out.stderr
    assert restore.active(pod.root).artifact.key == published.key

    env = sourced(pod.env_file)
    recipe = load(MODELS / f"{pod.recipe_name}.toml")
    for var, path in components.cache_env(pod.root).items():
        assert env[var] == path and Path(path).is_dir(), var
    assert all(env[k] == v for k, v in recipe.env.items())
    assert pod.env_file.read_text().startswith("export ")  # quoted for sh
    assert env["VLLM_CACHE_ROOT"].startswith(str(pod.mounts["/cache"]) + "/")

    result, started, command = pod.run_vllm()
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    assert started["VLLM_CACHE_ROOT"] == str(pod.root / "vllm") and started["TMPDIR"] == str(pod.root / "tmp")
    assert recipe.model in command and command[-2:] == ["--port", "8000"]  # the served path, then the pod's flags


def test_init_container_miss_exits_0_and_vllm_starts_cold_with_a_warning(s3_url, tmp_path):
    pod = Pod(tmp_path, s3_url)  # nothing published
    out = pod.run_init()
    assert out.returncode == 0, out.stderr
    assert "warning" in out.stderr and "no artifact" in out.stderr and "compile from cold" in out.stderr
    assert restore.active(pod.root) is None

    env = sourced(pod.env_file)  # still written: vLLM's caches go to the volume even on a miss
    assert env["VLLM_CACHE_ROOT"] == str(pod.root / "vllm") and Path(env["TMPDIR"]).is_dir()

    result, started, _ = pod.run_vllm()
    assert result.returncode == 0, result.stderr
    assert "no warmed cache is active" in result.stderr and "kubectl logs" in result.stderr
    assert started["VLLM_CACHE_ROOT"] == str(pod.root / "vllm")


def test_init_container_with_an_unreachable_store_still_starts_the_pod(s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    pod = Pod(tmp_path, s3_url)
    out = pod.run_init()
    assert out.returncode == 0, out.stderr
    assert "warmer: warning:" in out.stderr and "warmer fetch: miss" in out.stderr
    assert sourced(pod.env_file)["VLLM_CACHE_ROOT"] == str(pod.root / "vllm")



def test_env_values_with_spaces_survive_the_shell(s3_url, tmp_path):
    pod = Pod(tmp_path, s3_url)
    recipe_file = pod.mounts["/etc/warmer/recipes"] / f"{pod.recipe_name}.toml"
    recipe_file.write_text(recipe_file.read_text().replace(
        "[env]\n", "[env]\nFLASHINFER_CUDA_ARCH_LIST = \"9.0a 10.0a\"\nNVCC_APPEND_FLAGS = \"-Xptxas '-v' $HOME\"\n"))
    out = pod.run_init()
    assert out.returncode == 0, out.stderr
    env = sourced(pod.env_file)
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a 10.0a" and env["NVCC_APPEND_FLAGS"] == "-Xptxas '-v' $HOME"
    _, started, _ = pod.run_vllm()
    assert started["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a 10.0a"
