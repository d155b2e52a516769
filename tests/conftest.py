"""Shared helpers: a fake cache tree shaped like the real ones, and a recipe for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from warmer.recipe import Recipe, parse

REPO = Path(__file__).resolve().parent.parent
# The real S3 API on loopback, for the integration and the end-to-end tests.
pytest_plugins = ["tests.s3server"]


def make_cache_tree(root: Path) -> dict[str, bytes]:
    """Files under root as vLLM, Inductor and its headers would leave them, plus lock files."""
    files = {
        "vllm/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json": b'{"arch": "llama"}',
        "inductor/24/c244b2rga7kqcbbf2xhybporem2yeo55qusvywqyipbcdmkdmkrr.cpp": b"extern \"C\" void k() {}\n",
        "inductor/24/c244b2rga7kqcbbf2xhybporem2yeo55qusvywqyipbcdmkdmkrr.so": os.urandom(50_000),
        "inductor/fxgraph/mr/fmr4dcnt/6viof6iv": os.urandom(3000),
        "tmp/torchinductor_root/precompiled_headers/cipcx.h.gch": b"\0" * 200_000,
    }
    junk = ["inductor/locks/c244.lock", "tmp/torchinductor_root/precompiled_headers/locks/c.lock",
            "tmp/unrelated-scratch.txt"]
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    for rel in junk:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    return files


def _tiny_doc(model_path: str, engine: dict) -> dict:
    return {"name": "tiny", "model": {"path": model_path},
            "engine": {"max_model_len": 128, **engine}, "env": {"VLLM_USE_AOT_COMPILE": "0"},
            "workload": {"prompt_lengths": [8], "batch_sizes": [1], "max_tokens": 4}}


def tiny_recipe(model_path: str = "/models/tiny", **engine) -> Recipe:
    return parse(_tiny_doc(model_path, engine), Path("tiny.toml"))


def write_tiny_recipe(path: Path, model_path: str = "/models/tiny", **engine) -> Path:
    """The same recipe as tiny_recipe(), as a TOML file for the CLI."""
    doc = _tiny_doc(model_path, engine)
    lines = [f"name = {json.dumps(doc['name'])}"]
    for table in ("model", "engine", "env", "workload"):
        lines += [f"[{table}]"] + [f"{k} = {json.dumps(v)}" for k, v in doc[table].items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def publish_at_once(stores: list, artifacts: list[Path]) -> list[dict]:
    """build.publish of artifacts[i] to stores[i], all released together by a barrier: the race
    of builders publishing the same key."""
    from warmer import build

    barrier = threading.Barrier(len(artifacts))
    results: list = [None] * len(artifacts)

    def publish(i):
        barrier.wait()
        results[i] = build.publish(stores[i], artifacts[i])

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(artifacts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_python(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """This venv's python in a child process; a failure shows the child's own error, not just its exit code."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if out.returncode != 0:
        pytest.fail(f"python {' '.join(args)[:200]} exited {out.returncode}\n"
                    f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-6000:]}", pytrace=False)
    return out


def run_warmer(*args, **kw) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, as users run it."""
    kw.setdefault("cwd", REPO)
    return subprocess.run([sys.executable, "-m", "warmer", *map(str, args)], capture_output=True, text=True, **kw)


@pytest.fixture
def cache_tree(tmp_path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "build-root"
    return root, make_cache_tree(root)


@dataclass(frozen=True)
class Packed:
    path: Path                 # the artifact file
    artifact: "object"         # its warmer.artifact.Artifact
    files: dict[str, bytes]    # what it holds, by root-relative path
    source: Path               # the cache tree it was packed from


@pytest.fixture
def packed(tmp_path):
    """A factory of artifacts packed by warmer itself from the fake cache tree (plus extra files):
    packed("B", extra={"inductor/big.so": data}, recipe=..., fp=...). timings["build"]["name"]
    is the name, so a restored root says which artifact it holds."""
    from warmer import build

    def make(name: str = "a", *, extra: dict[str, bytes] | None = None, recipe: Recipe | None = None, fp=None,
             timings: dict | None = None) -> Packed:
        src = tmp_path / f"src-{name}"
        files = make_cache_tree(src)
        for rel, data in (extra or {}).items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(data)
            files[rel] = data
        path = tmp_path / f"{name}.tar.zst"
        art = build.pack_root(src, recipe or tiny_recipe(), path, fp=fp,
                              timings=timings if timings is not None else {"build": {"name": name}})
        return Packed(path, art, files, src)

    return make


@contextmanager
def time_cap(seconds: float):
    """Fail instead of hanging: SIGALRM interrupts a blocked open() or read() in this thread."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
