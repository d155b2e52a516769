"""The real vLLM CPU engine served by another user than the one that restored its root: root restores
(a systemd unit, an image build), uid 1000 serves (the pod). With the handover (`--owner`) the start
is warm; without it, `warmer serve` sends vLLM to a directory of its own, and it starts cold. In
neither case does vLLM crash on the lock files torch and vLLM write into the root even on a hit.

uid 1000 runs through setpriv with CAP_DAC_READ_SEARCH only (it reads and searches any directory,
to reach this machine's interpreter under /root; it writes only where its uid may)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python
from tests.e2e.test_loop_cpu import TINY, requires_vllm, served
from warmer import build, recipe as recipes, serving, warmup

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    (os.geteuid() != 0 or not shutil.which("setpriv")) and os.environ.get("CI") != "true",
    reason="needs root and setpriv (util-linux) to act as two users")]
SERVING = 1000
AS_SERVING = ["setpriv", f"--reuid={SERVING}", f"--regid={SERVING}", "--clear-groups",
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


@pytest.fixture(scope="module")
def shared():
    top = Path(tempfile.mkdtemp(prefix="warmer-own-e2e-", dir="/tmp"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def artifact(shared):
    """The tiny recipe warmed once from cold (one engine run, as root) and packed."""
    model = shared / "model"
    run_python("-m", "warmer.tinymodel", str(model))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMER_TINY_MODEL", str(model))
        recipe = recipes.load(TINY)
        warmup.run_engine(recipe, shared / "build-root", shared / "work", "cold")
        out = shared / "tiny.tar.zst"
        build.pack_root(shared / "build-root", recipe, out)
    home = shared / "home"
    home.mkdir()
    os.chown(home, SERVING, SERVING)
    return {"file": out, "model": model, "home": home, "recipe": recipe}


def restore_as_root(artifact: dict, root: Path, *extra: str) -> None:
    env = {**os.environ, "WARMER_TINY_MODEL": str(artifact["model"])}
    subprocess.run([sys.executable, "-m", "warmer", "restore", str(artifact["file"]), "--root", str(root), *extra],
                   env=env, cwd=REPO, check=True, capture_output=True)


@requires_vllm
def test_root_restores_uid_1000_serves_warm_with_the_handover_cold_without(shared, artifact, tmp_path):
    home = {"HOME": str(artifact["home"]), "PYTHONDONTWRITEBYTECODE": "1"}
    handed = shared / "cache-handed" / "tiny-llama-cpu"
    restore_as_root(artifact, handed, "--owner", f"{SERVING}:{SERVING}")
    warm = served(TINY, handed, None, artifact["model"], tmp_path, extra_env=home, label="serve-handed",
                  as_user=AS_SERVING)
    assert "PermissionError" not in warm["text"]
    assert warm["files"]["recompiled_files"] == 0, warm["files"]
    assert not [e for e in warmup.RECOMPILE_EVENTS if warm["log"]["events"][e]], warm["log"]

    kept = shared / "cache-root" / "tiny-llama-cpu"  # restored by root, no handover: root-owned
    restore_as_root(artifact, kept)
    cold_root = serving.cold_root(artifact["recipe"], SERVING)
    shutil.rmtree(cold_root, ignore_errors=True)
    cold = served(TINY, kept, None, artifact["model"], tmp_path, extra_env=home, label="serve-root-owned",
                  as_user=AS_SERVING)
    assert "PermissionError" not in cold["text"]
    assert f"{kept} is not writable by this user (uid {SERVING})" in cold["text"]
    assert cold["files"]["recompiled_files"] == 0  # nothing written into the root it could not write
    assert any(p.suffix == ".so" for p in (cold_root / "inductor").rglob("*")), "vLLM did not compile cold there"
    shutil.rmtree(cold_root, ignore_errors=True)
