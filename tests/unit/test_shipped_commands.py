"""The shipped manifests' own commands, taken from their files and run here as the node runs them:
the prefetch DaemonSet's shell loop as PID 1 of a PID namespace (how a container's first process
sees signals), and cache-owner's chown as root holding CHOWN alone, with the pods' user writing
under the cache afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.unit.test_manifests import of_kind, pod_spec


def _daemonset() -> dict:
    (_, ds), = of_kind("DaemonSet")
    return ds


def _prefetch_script() -> str:
    (c,) = [c for c in pod_spec(_daemonset())["containers"] if c["name"] == "prefetch"]
    assert c["command"] == ["sh", "-c"]
    return c["args"][0]


def _pid_namespace() -> list[str]:
    """unshare's argv that runs a command as PID 1 of a new PID namespace: as root, or inside a
    user namespace of one's own where that is allowed."""
    unshare = shutil.which("unshare")
    if not unshare:
        pytest.skip("unshare (util-linux) is not installed: no PID namespace to run the loop as PID 1 in")
    for argv in ([unshare, "--pid", "--fork"], [unshare, "--user", "--map-root-user", "--pid", "--fork"]):
        if subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode == 0:
            return argv
    pytest.skip("this machine allows no new PID namespace (neither as root nor in a user namespace)")


def _processes() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, command name)} of every process, from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            out[int(d.name)] = (int(fields[1]), comm)
    return out


def _children(pid: int) -> list[tuple[int, str]]:
    return [(p, comm) for p, (ppid, comm) in _processes().items() if ppid == pid]


def _descendants(pid: int) -> list[tuple[int, str]]:
    procs, out, todo = _processes(), [], [pid]
    while todo:
        parent = todo.pop()
        for p, (ppid, comm) in procs.items():
            if ppid == parent:
                out.append((p, comm))
                todo.append(p)
    return out


def _until(what, timeout: float = 20.0):
    """what()'s first true value, polled until timeout (a bounded wait, never a fixed sleep)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (value := what()):
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {getattr(what, '__name__', what)}")


def run_as_pid1_and_terminate(script: str, tmp_path: Path, fetch_blocks: bool,
                              grace: float = 10.0) -> tuple[int | None, float]:
    """Run the loop as PID 1 with `warmer` a stub on PATH; once it is in the fetch (a stub that
    blocks) or in the hourly sleep (a stub that returns at once), send SIGTERM from outside, as the
    kubelet does. Returns (its exit status, or None if still running after grace seconds; seconds taken)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "fetched"
    (bin_dir / "warmer").write_text(f'#!/bin/sh\necho "$@" > "{marker}"\n'
                                    + ("exec sleep 3600\n" if fetch_blocks else "exit 0\n"))
    (bin_dir / "warmer").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.Popen([*_pid_namespace(), "sh", "-c", script], env=env, start_new_session=True)
    try:
        (sh, _), = _until(lambda: _children(proc.pid))
        _until(marker.exists)
        assert marker.read_text().startswith("fetch --all")
        # The loop is in the fetch (the stub blocks in a sleep) or in the hourly sleep after it.
        _until(lambda: [p for p, comm in _descendants(sh) if comm == "sleep"])
        start = time.monotonic()
        os.kill(sh, signal.SIGTERM)
        try:
            return proc.wait(timeout=grace), time.monotonic() - start
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.parametrize("fetch_blocks", [True, False], ids=["during-the-fetch", "during-the-sleep"])
def test_the_prefetch_loop_exits_promptly_on_sigterm_as_pid_1(tmp_path, fetch_blocks):
    """The kernel delivers PID 1 no signal it has no handler for: a loop without a trap would sit out
    the pod's grace period and die by SIGKILL. The shipped loop exits 143 at once, wherever it is."""
    status, took = run_as_pid1_and_terminate(_prefetch_script(), tmp_path, fetch_blocks)
    assert status == 143, f"exit status {status} after {took:.1f} s"
    assert took < 5


def test_the_harness_sees_a_loop_without_a_trap_ignore_sigterm(tmp_path):
    """The control: the loop as it once shipped, with no trap, is still running 2 s after SIGTERM
    (the shipped one exits within milliseconds)."""
    old = ("while :; do\n  warmer fetch --all /etc/warmer --root-base /cache --metrics-file /metrics/warmer.prom\n"
           "  sleep 3600\ndone\n")
    status, _ = run_as_pid1_and_terminate(old, tmp_path, fetch_blocks=False, grace=2.0)
    assert status is None


# --- cache-owner: root with CHOWN alone, then the pods' user writes below it ---------------------

def _as(uid: int, gid: int, caps: str, argv: list[str]) -> subprocess.CompletedProcess:
    """argv as uid:gid, with only the capabilities named ('-all,+chown'), no new privileges."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
                            f"--bounding-set={caps}", "--inh-caps=-all", "--", *argv],
                           capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("kind", ["Deployment", "DaemonSet"])
def test_cache_owner_hands_the_hostpath_to_the_pods_user(kind):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux): the chown runs as root with CHOWN alone, the writes "
                    "as the pods' user")
    (_, doc), *_ = of_kind(kind)
    ps = pod_spec(doc)
    uid, gid = ps["securityContext"]["runAsUser"], ps["securityContext"]["runAsGroup"]
    (owner,) = [c for c in ps["initContainers"] if c["name"] == "cache-owner"]
    # Each mount point as the kubelet leaves a hostPath it created: root's, 0755 (in a directory
    # every user can reach: pytest's own tmp_path is 0700).
    node = Path(tempfile.mkdtemp(prefix="warmer-hostpath-"))
    try:
        node.chmod(0o755)
        mounts = {m["mountPath"]: node / m["name"] for m in owner["volumeMounts"]}
        for d in mounts.values():
            d.mkdir(mode=0o755)
        # What torch and vLLM write under the root even on a full hit.
        writes = ["mkdir", "-p", *(str(d / "llama" / "inductor" / "locks") for d in mounts.values()),
                  *(str(d / "llama" / "tmp" / "vllm_dist_x") for d in mounts.values())]
        assert _as(uid, gid, "-all", writes).returncode != 0  # the problem: root's 0755 mount point
        argv = [str(mounts.get(a, a)) for a in owner["command"] + owner.get("args", [])]
        chown = _as(0, 0, "-all,+chown", argv)
        assert chown.returncode == 0, chown.stderr
        for d in mounts.values():
            assert (d.stat().st_uid, d.stat().st_gid) == (uid, gid)
        done = _as(uid, gid, "-all", writes)
        assert done.returncode == 0, done.stderr
    finally:
        shutil.rmtree(node)
