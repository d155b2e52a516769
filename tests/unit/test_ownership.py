"""The serving process owns what it writes: a root warmer hands to vLLM is one the serving user can
write (torch and vLLM write locks and temporary files into it even on a full hit), or it is not
handed at all. Two real users: root restores, uid 1000 serves.

uid 1000 runs through setpriv with one ambient capability, CAP_DAC_READ_SEARCH, so that it can
reach this machine's interpreter (under /root, 0700) and the tests' files: it reads and searches
any directory, and writes only where its uid may, which is all these tests are about."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, write_tiny_recipe
from warmer import build, restore, workspace
from warmer.envfile import EnvFile
from warmer.recipe import load
from warmer.store import open_store

SERVING = 1000
pytestmark = pytest.mark.skipif(
    (os.geteuid() != 0 or not shutil.which("setpriv")) and os.environ.get("CI") != "true",
    reason="needs root and setpriv (util-linux) to act as two users")


@pytest.fixture
def shared(tmp_path):
    """A directory both users can reach (pytest's own is 0700): root-owned, 0755, like a hostPath."""
    top = Path(tempfile.mkdtemp(prefix="warmer-own-", dir="/tmp"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def node(shared, packed):
    """A file store with the tiny recipe's artifact, and the recipe file."""
    store = shared / "store"
    build.publish(open_store(f"file://{store}"), packed("a").path)
    recipe = write_tiny_recipe(shared / "tiny.toml")
    home = shared / "home"
    home.mkdir()
    os.chown(home, SERVING, SERVING)
    return {"store": f"file://{store}", "recipe": recipe, "home": home, "base": shared / "cache"}


def warmer(*args, uid: int | None = None, home: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return python("-m", "warmer", *args, uid=uid, home=home, **env)


def python(*args, uid: int | None = None, home: Path | None = None, **more: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, *map(str, args)]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **more}
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
                "--ambient-caps=+dac_read_search", *argv]
        env["HOME"] = str(home)
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def env_of(out: subprocess.CompletedProcess) -> dict[str, str]:
    """The `export K=V` lines of serve --dry-run."""
    return dict(line[len("export "):].split("=", 1) for line in out.stdout.splitlines() if line.startswith("export "))


def _outsider() -> list[str]:
    """unshare's argv that runs a command as a user the kernel grants nothing on files of unmapped
    owners: root in a user namespace of its own (root here passes every permission check)."""
    argv = [shutil.which("unshare") or "unshare", "--user", "--map-root-user"]
    if subprocess.run([*argv, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("this machine allows no user namespace: no user without rights to act as")
    return argv


def test_a_root_owned_root_is_never_handed_to_vllm(node):
    """As a root systemd unit or a root image build leaves it: served by uid 1000, vLLM would crash."""
    root = node["base"] / "tiny"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require")
    assert out.returncode == 0 and os.stat(root / "inductor").st_uid == 0, out.stderr
    cold = restore.cold_root(load(node["recipe"]).name, SERVING)

    refused = warmer("serve", node["recipe"], "--root", root, "--dry-run", "--require-hit", uid=SERVING,
                     home=node["home"])
    assert refused.returncode == 3, refused.stderr
    assert f"{root} is not writable by this user (uid {SERVING})" in refused.stderr
    assert f"chown -R {SERVING}:{SERVING} {root}" in refused.stderr and f"--owner {SERVING}:{SERVING}" in refused.stderr

    cold_start = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"])
    assert cold_start.returncode == 0, cold_start.stderr
    env = env_of(cold_start)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cold / "inductor") and env["TMPDIR"] == str(cold / "tmp")
    assert not [v for v in env.values() if v.startswith(str(root))]  # nothing points into the root
    assert os.stat(cold).st_uid == SERVING and stat.S_IMODE(os.stat(cold).st_mode) == 0o700
    shutil.rmtree(cold)

    doctor = warmer("doctor", "--root", root, "--json", uid=SERVING, home=node["home"])
    assert doctor.returncode == 5, doctor.stdout + doctor.stderr
    import json
    [finding] = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "ownership"]
    assert finding["severity"] == "error" and f"uid {SERVING}" in finding["what"]
    assert f"chown -R {SERVING}:{SERVING} {root}" in finding["fix"]


def test_the_lock_a_root_fetch_left_is_named_with_its_fix(node):
    """A fetch run as root without --owner leaves the root and its lock (beside it, 0600) root's.
    The printed fix chowned the root alone: the serving user's fetches still failed on the lock,
    blamed on the root's (writable) parent, and no newer build was ever activated."""
    root = node["base"] / "tiny"
    lock = restore.lock_path(root)
    assert warmer("fetch", node["recipe"], "--store", node["store"], "--root", root).returncode == 0
    refused = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"])
    assert (f"chown {SERVING}:{SERVING} {node['base']} && chown -R {SERVING}:{SERVING} {root} {lock}` as root"
            in refused.stderr), refused.stderr
    for p in (node["base"], *root.rglob("*"), root):  # the root handed over, its lock not
        os.lchown(p, SERVING, SERVING)
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require", uid=SERVING,
                 home=node["home"])
    assert out.returncode == 3, out.stderr
    assert f"the lock {lock} belongs to uid 0" in out.stderr and f"`chown {SERVING}:GID {lock}`" in out.stderr
    os.chown(lock, SERVING, SERVING)
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require", uid=SERVING,
                 home=node["home"])
    assert out.returncode == 0 and "already-active" in out.stderr, out.stderr


def test_an_env_file_on_the_stdout_pipe_the_runtime_made_is_written_by_the_serving_user(node):
    """A container run as uid 1000 writes fd 1, a pipe the runtime made as root (0600), which it may
    not open again: `--env-file /dev/stdout` was refused as '/dev is not a directory this user can
    write' before anything was fetched."""
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", node["home"] / "r", "--env-file",
                 "/dev/stdout", uid=SERVING, home=node["home"])
    assert out.returncode == 0, out.stderr
    assert f"VLLM_CACHE_ROOT={node['home'] / 'r' / 'vllm'}" in out.stdout, out.stdout


def test_publish_in_layers_from_a_folder_the_publisher_cannot_write(shared, packed, node):
    """A release pipeline publishes the artifact where the build left it, a folder it may only read:
    each layer's part was written beside the artifact, and the publish failed on it."""
    art = shared / "art"
    art.mkdir()
    shutil.copy(packed("a").path, art / "a.tar.zst")
    (art / "a.tar.zst").chmod(0o644)
    store = shared / "layered"
    store.mkdir()
    os.chown(store, SERVING, SERVING)
    out = warmer("publish", art / "a.tar.zst", "--store", f"file://{store}", "--layers", uid=SERVING,
                 home=node["home"], TMPDIR=str(node["home"]))
    assert out.returncode == 0 and "published" in out.stdout + out.stderr, out.stderr
    assert [p.name for p in art.iterdir()] == ["a.tar.zst"] and not list(node["home"].glob("a.tar.zst.*"))


def test_a_cold_directory_another_user_made_first_in_a_shared_tmp_is_not_taken(node, shared):
    """The systemd path shares /tmp: uid 2000 makes warmer-cold-tiny-1000 there first, world-writable.
    serve, as uid 1000 on a root it cannot write, pointed vLLM's Inductor and Triton caches (kernels
    it loads and runs) into it. It takes a fresh directory of its own instead."""
    tmp = shared / "tmp"
    tmp.mkdir(mode=0o1777)
    tmp.chmod(0o1777)
    planted = tmp / "warmer-cold-tiny-1000"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    os.chown(planted, 2000, 2000)
    root = node["base"] / "tiny"
    assert warmer("fetch", node["recipe"], "--store", node["store"], "--root", root).returncode == 0  # root's

    served = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"],
                    TMPDIR=str(tmp))
    assert served.returncode == 0, served.stderr
    cold = Path(env_of(served)["TORCHINDUCTOR_CACHE_DIR"]).parent
    assert cold.parent == tmp and cold != planted and cold.name.startswith("warmer-cold-tiny-1000-"), cold
    st = os.lstat(cold)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (SERVING, 0o700)
    assert not any(planted.iterdir())

    planted.rmdir()  # gone: serve makes the directory of that name, as its own
    again = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"],
                   TMPDIR=str(tmp))
    assert Path(env_of(again)["TORCHINDUCTOR_CACHE_DIR"]).parent == planted, again.stderr
    assert (os.lstat(planted).st_uid, stat.S_IMODE(os.lstat(planted).st_mode)) == (SERVING, 0o700)


def test_the_printed_chown_lets_the_serving_users_fetch_activate_the_next_build(node, packed):
    """A root fetched by root without --owner: the fix serve prints, pasted, must hold past the next
    build. It chowned the root (and its lock) alone: the next fetch as the serving user, of a new build
    of the key, failed making its staging directory beside the root, and vLLM went on with the old."""
    root = node["base"] / "tiny"
    assert warmer("fetch", node["recipe"], "--store", node["store"], "--root", root).returncode == 0
    said = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"]).stderr
    fix = re.search(r"or `(chown [^`]+)` as root", said)
    assert fix, said
    subprocess.run(["sh", "-c", fix[1]], check=True)
    store = open_store(node["store"])
    [(_, key)] = store.list_index()
    assert warmer("rm", f"{node['store']}/index/tiny/{key}", "--yes").returncode == 0
    newer = packed("newer", extra={"inductor/newer.bin": b"a newer build"})
    assert newer.artifact.key == key
    build.publish(store, newer.path)
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require", uid=SERVING,
                 home=node["home"])
    assert out.returncode == 0, out.stderr
    assert (root / "inductor" / "newer.bin").read_bytes() == b"a newer build"


def test_owner_hands_the_restored_root_to_the_serving_user(node):
    root = node["base"] / "tiny"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--owner",
                 f"{SERVING}:{SERVING}", "--require")
    assert out.returncode == 0, out.stderr
    owners = {(st.st_uid, st.st_gid) for p in [root, *root.rglob("*")] for st in [os.lstat(p)]}
    assert owners == {(SERVING, SERVING)}
    lock = restore.lock_path(root)
    assert (os.stat(lock).st_uid, stat.S_IMODE(os.stat(lock).st_mode)) == (SERVING, 0o600)

    served = warmer("serve", node["recipe"], "--root", root, "--dry-run", "--require-hit", uid=SERVING,
                    home=node["home"])
    assert served.returncode == 0, served.stderr
    assert env_of(served)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    again = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--json", uid=SERVING,
                   home=node["home"])
    assert again.returncode == 0 and '"status": "already-active"' in again.stdout, again.stderr
    doctor = warmer("doctor", "--root", root, "--json", uid=SERVING, home=node["home"])
    assert '"check": "ownership"' not in doctor.stdout


def test_a_root_restored_by_root_is_handed_over_whole_though_a_miss_in_between_handed_over_its_top(node, tmp_path):
    """Restored by root without --owner, then one --owner fetch missed (the store unreachable): that
    miss readied the root, handing its top directories to uid 1000. The next --owner fetch, a no-op,
    must hand over the rest: it looked at the root's top alone and left every restored directory
    root's, where vLLM writes (vllm/modelinfos) even on a full hit, while it pointed vLLM there.
    (A store that offers nothing now keeps a root of this key's whole artifact, a no-op that hands
    it over whole: the miss's readying, what its activate does, is made here directly.)"""
    root = node["base"] / "tiny"
    assert warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require").returncode == 0
    restore.prepare(root, (SERVING, SERVING))  # what a miss with --owner left
    assert os.stat(root).st_uid == SERVING
    assert {os.lstat(p).st_uid for p in root.rglob("*")} == {0, SERVING}  # the restored tree: still root's

    again = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--owner",
                   f"{SERVING}:{SERVING}", "--json")
    assert again.returncode == 0 and '"status": "already-active"' in again.stdout, again.stderr
    assert {os.lstat(p).st_uid for p in [root, *root.rglob("*")]} == {SERVING}


def test_a_file_gone_while_ownership_is_looked_at_is_no_failure(tmp_path, monkeypatch):
    """A running vLLM's FlashInfer build makes and deletes temporary files in the shared workspace
    while a root --owner fetch looks at who owns it: a name listed, then gone before its stat, is
    skipped (it failed the no-op fetch as "not activated"). The race is made certain by a stat that
    finds the listed file gone: no real writer can be timed to it."""
    (tmp_path / "kept").touch()
    (tmp_path / "obj.o.tmp").touch()
    for name in ("stat", "lstat"):
        real = getattr(os, name)

        def gone(path, *args, real=real, **kwargs):
            if not isinstance(path, int) and os.path.basename(path) == "obj.o.tmp":  # fwalk stats fds too
                raise FileNotFoundError(2, "No such file or directory", path)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, gone)
    assert restore._owned_otherwise(tmp_path, (0, 0)) is False
    os.chown(tmp_path / "kept", SERVING, SERVING)
    assert restore._owned_otherwise(tmp_path, (0, 0)) is True


def test_a_root_the_serving_user_cannot_get_to_is_not_handed_over_and_its_capabilities_count(node):
    """A root handed to uid 1000 under a directory only root may search (0700). fetch, judging a pod
    without capabilities, must not point vLLM there (it would crash on its lock files): the root is
    handed over, but the env sends vLLM to a cold directory, and --require says it is no hit. A
    serving process that does reach it (here through CAP_DAC_READ_SEARCH) judges itself as vLLM's
    own writes will be judged, effective ids and capabilities: `warmer serve` then serves from it
    (access(2) with the real uid drops a non-root user's capabilities, and sent it cold)."""
    hidden = node["base"] / "hidden"
    hidden.mkdir(parents=True)
    hidden.chmod(0o700)  # root's
    root, env_file = hidden / "tiny", node["home"] / "vllm.env"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--owner",
                 f"{SERVING}:{SERVING}", "--env-file", env_file, "--require")
    assert out.returncode == 3, out.stderr
    assert f"{root} is not writable by uid {SERVING}" in out.stderr
    assert (f"{hidden} (above it) is owned by 0:0 with mode drwx------: uid {SERVING} cannot get through it"
            in out.stderr)
    # the fix is the way there, not the root's owner: neither --owner (given) nor a chown of the root helps
    assert f"Fix: `chmod o+x {hidden}`, or a root under directories uid {SERVING} can search" in out.stderr
    assert "chown" not in out.stderr and "fetch as root with `--owner" not in out.stderr
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert not [v for v in written.values() if v.startswith(str(root))]
    assert {os.lstat(p).st_uid for p in [root, *root.rglob("*")]} == {SERVING}  # handed over all the same

    served = warmer("serve", node["recipe"], "--root", root, "--dry-run", "--require-hit", uid=SERVING,
                    home=node["home"])
    assert served.returncode == 0, served.stderr
    assert env_of(served)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")


def test_restore_of_a_file_hands_over_a_root_the_serving_user_is_served_from(node, packed):
    """The image build's `warmer restore FILE --owner` (manifests/docker/Dockerfile, baked-from-file):
    the cache directories no artifact holds (an empty FlashInfer autotune dir) are made and handed
    over as fetch makes them, or `warmer serve` in the pod found one missing and started vLLM cold."""
    root = node["base"] / "tiny"
    out = warmer("restore", packed("a").path, "--root", root, "--owner", f"{SERVING}:{SERVING}")
    assert out.returncode == 0, out.stderr
    assert restore.unwritable(root, (SERVING, SERVING)) is None
    assert {os.lstat(p).st_uid for p in [root, *root.rglob("*")]} == {SERVING}
    served = warmer("serve", node["recipe"], "--root", root, "--dry-run", "--require-hit", uid=SERVING,
                    home=node["home"])
    assert served.returncode == 0, served.stderr
    assert env_of(served)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")


def test_restore_of_a_file_warns_of_a_root_the_serving_user_cannot_get_to(node, packed):
    """As fetch --owner judges it (an unwritable root, a cold start): an image built with
    `warmer restore FILE --owner` under a directory only root may search shipped without a word, and
    every pod started cold. The restore says so, with the fix: a warning, as the modes are all it
    judges by (the serving process may hold a capability, or a group its pod's spec gives it)."""
    hidden = node["base"] / "hidden"
    hidden.mkdir(parents=True)
    hidden.chmod(0o700)  # root's
    out = warmer("restore", packed("a").path, "--root", hidden / "tiny", "--owner", f"{SERVING}:{SERVING}", "--json")
    assert out.returncode == 0, out.stderr
    said = f"{hidden / 'tiny'} is restored, but by its modes uid {SERVING}, the user vLLM runs as, cannot write it"
    assert said in out.stderr and f"Fix: `chmod o+x {hidden}`" in out.stderr and "chown" not in out.stderr
    assert said in json.loads(out.stdout)["warnings"][0]


def test_a_missing_cache_directory_is_made_only_where_the_serving_user_may_make_it(node):
    """A root handed over, then missing its FlashInfer autotune directory (an older warmer readied
    it). Where uid 1000 may make it, serve does and serves from the root, and doctor says what serve
    will do (a warning, not an error: it exits 0). Where the directory above it is root's, serve
    starts cold elsewhere with the fix; it crashed on mkdir's PermissionError."""
    root, env_file = node["base"] / "tiny", node["home"] / "vllm.env"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--owner", f"{SERVING}:{SERVING}",
                 "--env-file", env_file)
    assert out.returncode == 0, out.stderr
    fi = root / "flashinfer"
    shutil.rmtree(fi / ".cache")

    doctor = warmer("doctor", "--root", root, "--env-file", env_file, "--json", uid=SERVING, home=node["home"])
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    import json
    [finding] = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "ownership"]
    assert finding["severity"] == "warning" and "`warmer serve` makes it" in finding["what"], finding

    os.chown(fi, 0, 0)  # the directory above the missing one: root's, 0755
    refused = warmer("serve", node["recipe"], "--root", root, "--dry-run", uid=SERVING, home=node["home"])
    assert refused.returncode == 0 and "Traceback" not in refused.stderr, refused.stderr
    assert f"{root} is not writable by this user (uid {SERVING}): {fi} is owned by 0:0" in refused.stderr
    assert env_of(refused)["TORCHINDUCTOR_CACHE_DIR"] == str(restore.cold_root("tiny", SERVING) / "inductor")
    shutil.rmtree(restore.cold_root("tiny", SERVING), ignore_errors=True)

    os.chown(fi, SERVING, SERVING)
    served = warmer("serve", node["recipe"], "--root", root, "--dry-run", "--require-hit", uid=SERVING,
                    home=node["home"])
    assert served.returncode == 0, served.stderr
    assert env_of(served)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert os.stat(fi / ".cache" / "flashinfer" / "autotune").st_uid == SERVING
    doctor = warmer("doctor", "--root", root, "--json", uid=SERVING, home=node["home"])
    assert '"check": "ownership"' not in doctor.stdout


def test_the_owners_class_of_the_mode_decides_for_the_owner_as_the_kernel_does(shared):
    """Owner bits r-x, others' rwx: the kernel takes the owner's class alone, so uid 1000 may not
    write its own directory (root, judging for it, once said it could, from the others' bits)."""
    d = shared / "d"
    d.mkdir()
    os.chown(d, SERVING, SERVING)
    d.chmod(0o577)
    assert restore.unwritable(d, (SERVING, SERVING), [d]) == f"{d} is owned by 1000:1000 with mode dr-xrwxrwx"
    assert python("-c", f"import os; print(os.access({str(d)!r}, os.W_OK))", uid=SERVING, home=shared).stdout == "False\n"
    d.chmod(0o755)
    assert restore.unwritable(d, (SERVING, SERVING), [d]) is None


def test_a_metrics_file_the_fetching_user_can_write_is_taken(node):
    """The node_exporter directory reached through a capability (here CAP_DAC_READ_SEARCH, past a
    0700 directory of root's): fetch's check before the fetch judges as the write will, and the
    metrics are written; it refused the pod's fetch as a usage error (exit 2)."""
    metrics = node["base"] / "hidden" / "metrics"
    metrics.mkdir(parents=True)
    metrics.parent.chmod(0o700)  # root's
    os.chown(metrics, SERVING, SERVING)
    node["base"].chmod(0o777)  # uid 1000 makes its root beside it
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", node["base"] / "tiny",
                 "--metrics-file", metrics / "warmer.prom", uid=SERVING, home=node["home"])
    assert out.returncode == 0, out.stderr
    assert 'warmer_fetch_status{recipe="tiny",status="hit"} 1' in (metrics / "warmer.prom").read_text()


def test_a_fetch_that_cannot_write_its_root_points_vllm_elsewhere(node):
    """The issue's case: uid 1000 fetches under a directory kubelet made root-owned (hostPath
    DirectoryOrCreate). The pod must start (cold), never crash on PermissionError."""
    node["base"].mkdir(mode=0o755)
    root, env_file = node["base"] / "tiny", node["home"] / "vllm.env"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--env-file", env_file,
                 uid=SERVING, home=node["home"])
    assert out.returncode == 0, out.stderr
    assert f"{root} is not writable by uid {SERVING}" in out.stderr and "Fix:" in out.stderr
    cold = restore.cold_root(load(node["recipe"]).name, SERVING)
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert written["TORCHINDUCTOR_CACHE_DIR"] == str(cold / "inductor")
    assert not [v for v in written.values() if v.startswith(str(root))]
    required = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require",
                      uid=SERVING, home=node["home"])
    assert required.returncode == 3, required.stderr
    # the root was never made: the fix hands over the directory it and its lock are made in (a chown -R
    # of the root named a path that does not exist), and followed, the next fetch hits
    assert f"`chown {SERVING}:{SERVING} {node['base']}` as root" in out.stderr and "chown -R" not in out.stderr
    os.chown(node["base"], SERVING, SERVING)
    fixed = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--require",
                   uid=SERVING, home=node["home"])
    assert fixed.returncode == 0, fixed.stderr


def test_a_root_the_fetching_user_cannot_enter_is_a_cold_start_not_a_failed_pod(node, tmp_path):
    """A root another user owns, that this one cannot even enter (0700; or 0750 root:root, as a root
    fetch under umask 027 leaves it): fetch --env-file, as the Deployment runs it, and serve failed on
    a PermissionError (a look for a symlink in it) before judging the root, and the pod never
    started. The user here is root in a user namespace where the root's owner is not mapped: the
    kernel grants it nothing there, as to any other user."""
    root, env_file = node["base"] / "tiny", tmp_path / "vllm.env"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--owner", "2000:2000")
    assert out.returncode == 0, out.stderr
    root.chmod(0o700)
    other = [*_outsider(), sys.executable, "-m", "warmer"]
    fetched = subprocess.run([*other, "fetch", node["recipe"], "--store", node["store"], "--root", root,
                              "--env-file", env_file], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    assert f"{root} is not writable" in fetched.stderr
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert written["TORCHINDUCTOR_CACHE_DIR"] != str(root / "inductor")
    assert not [v for v in written.values() if v.startswith(str(root))]
    served = subprocess.run([*other, "serve", node["recipe"], "--root", root, "--dry-run"], capture_output=True,
                            text=True, cwd=REPO, timeout=120)
    assert served.returncode == 0, served.stderr
    assert f"{root} is not writable" in served.stderr
    assert not [v for v in env_of(served).values() if v.startswith(str(root))]


def test_a_root_under_a_directory_the_user_cannot_search_is_a_cold_start_with_the_fix_that_helps(node, tmp_path):
    """/cache and /cache/tiny both 0750 root:root (a root fetch under umask 027 made both): fetch
    --env-file, serve and doctor as another user failed with a bare Permission denied (pathlib's
    tests raise on EACCES). Now they judge the root: fetch and serve start vLLM cold, doctor reports
    it, and the fix is the directory in the way, not a chown of the root. The user is root in a user
    namespace where the owner is not mapped (the kernel grants it nothing there)."""
    root, env_file = node["base"] / "tiny", tmp_path / "vllm.env"
    assert warmer("fetch", node["recipe"], "--store", node["store"], "--root", root).returncode == 0
    for d in (node["base"], root):
        os.chown(d, 2000, 2000)
        d.chmod(0o750)
    other = [*_outsider(), sys.executable, "-m", "warmer"]

    def run(*args):
        return subprocess.run([*other, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=120)

    fix = f"`chmod o+x {node['base']}`"
    fetched = run("fetch", node["recipe"], "--store", node["store"], "--root", root, "--env-file", env_file)
    assert fetched.returncode == 0, fetched.stderr
    assert fix in fetched.stderr and "chown" not in fetched.stderr
    assert not [v for v in EnvFile.parse(env_file.read_text(), "f").vars.values() if v.startswith(str(root))]
    served = run("serve", node["recipe"], "--root", root, "--dry-run")
    assert served.returncode == 0, served.stderr
    assert f"{node['base']} (above it) is owned by" in served.stderr and fix in served.stderr  # by nobody, here
    assert not [v for v in env_of(served).values() if v.startswith(str(root))]
    doctor = run("doctor", "--root", root, "--recipe", node["recipe"])
    assert "ERROR   ownership" in doctor.stdout and fix in doctor.stdout, doctor.stdout + doctor.stderr


def test_the_fix_for_a_root_past_a_directory_names_the_one_the_serving_user_cannot_search(shared):
    """/x is 0750 root:1000, so uid 1000 of group 1000 gets through it by its group: the fix is not to
    open /x to everyone. Past /x/y (0700 root:root) only chmod of /x/y helps; where the way is open
    and the root is root's, the chown."""
    from warmer import doctor

    owner = (SERVING, SERVING)
    x = shared / "x"
    x.mkdir(mode=0o750)
    os.chown(x, 0, SERVING)
    (x / "tiny").mkdir(mode=0o755)  # root's, as a root fetch without --owner leaves it
    assert restore.blocked_above(x / "tiny", owner) is None
    assert "chown -R" in restore.ownership_fix(x / "tiny", owner) and "chmod" not in restore.ownership_fix(
        x / "tiny", owner)
    [found] = doctor._ownership(x / "tiny", owner, False)
    assert "chown -R" in found.fix and "chmod" not in found.fix
    assert restore.blocked_above(x / "tiny", (SERVING, 4242)) == x  # another group: /x is in the way

    y = x / "y"
    y.mkdir(mode=0o700)
    assert restore.blocked_above(y / "tiny", owner) == y
    assert restore.ownership_fix(y / "tiny", owner).startswith(f"Fix: `chmod o+x {y}`")
    # a directory that does not exist yet is made, not searched: no chmod of it; nor is / ever handed over
    missing = shared / "not-yet" / "cache" / "tiny"
    assert restore.blocked_above(missing, (os.geteuid(), os.getegid())) is None
    assert f"`install -d -o {SERVING} -g {SERVING} {missing.parent}` as root" in restore.ownership_fix(missing, owner)
    at_top = restore.ownership_fix(Path("/warmer-test-tiny"), owner)
    assert "chown 1000:1000 / " not in at_top and "install -d" in at_top and "--root /cache/warmer-test-tiny" in at_top


def test_owner_needs_root(node):
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", node["home"] / "r", "--owner", "0:0",
                 uid=SERVING, home=node["home"])
    assert out.returncode == 2 and "--owner 0:0 needs root" in out.stderr, out.stderr
    assert not (node["home"] / "r").exists()


def published_module(shared: Path, layers: bool = False) -> tuple[Path, str]:
    """(the root base, the file store) of an artifact built in the shared FlashInfer workspace
    (warmer/workspace.py) and published: one module, silu_and_mul; the build's root base removed."""
    from tests.unit.test_shared_workspace import HAS_FLASHINFER, _module, _pack
    if not HAS_FLASHINFER:
        pytest.skip("flashinfer-python is not installed")
    base, out = shared / "cache", shared / "tiny.tar.zst"
    _pack(base / "tiny", "tiny", _module("silu_and_mul", os.urandom(20_000)), out)
    shutil.rmtree(base)
    store = f"file://{shared / 'store'}"
    build.publish(open_store(store), out, layers=layers)
    return base, store


def test_owner_hands_the_shared_flashinfer_workspace_to_the_serving_user(shared):
    """An artifact built in the shared FlashInfer workspace (warmer/workspace.py), fetched as root
    with --owner: the workspace beside the roots is the serving user's too (vLLM writes FlashInfer's
    locks and new modules there), and that user's later fetch finds it intact."""
    base, store = published_module(shared)
    recipe, home, root = write_tiny_recipe(shared / "tiny.toml"), shared / "home", base / "tiny"
    home.mkdir()
    os.chown(home, SERVING, SERVING)

    got = warmer("fetch", recipe, "--store", store, "--root", root, "--owner", f"{SERVING}:{SERVING}", "--require")
    assert got.returncode == 0, got.stderr
    ws = Path(os.path.realpath(root / "flashinfer"))
    assert ws.parent.parent == base / ".flashinfer"
    owners = {(st.st_uid, st.st_gid) for p in [ws.parent, *ws.parent.rglob("*")] for st in [os.lstat(p)]}
    assert owners == {(SERVING, SERVING)}

    served = warmer("serve", recipe, "--root", root, "--dry-run", uid=SERVING, home=home)
    assert served.returncode == 0 and env_of(served)["FLASHINFER_WORKSPACE_BASE"] == str(ws), served.stderr
    again = warmer("fetch", recipe, "--store", store, "--root", root, "--json", uid=SERVING, home=home)
    assert again.returncode == 0 and '"status": "already-active"' in again.stdout, again.stderr


def test_owner_on_a_root_already_active_hands_over_the_shared_flashinfer_workspace_too(shared):
    """A node fetched as root without --owner, then with it (its pods now run as uid 1000): the fetch is
    a no-op, and hands over the root and the workspace beside it, whose module locks FlashInfer takes
    on every load (cached_ops/tmp/M.lock: as root's, vLLM failed at start on PermissionError)."""
    base, store = published_module(shared, layers=True)
    recipe, root = write_tiny_recipe(shared / "tiny.toml"), base / "tiny"

    assert warmer("fetch", recipe, "--store", store, "--root", root, "--require").returncode == 0
    ws = Path(os.path.realpath(root / "flashinfer"))
    [lock] = ws.rglob("cached_ops/tmp/silu_and_mul.lock")
    assert os.stat(lock).st_uid == 0

    again = warmer("fetch", recipe, "--store", store, "--root", root, "--owner", f"{SERVING}:{SERVING}", "--json")
    assert again.returncode == 0 and '"status": "already-active"' in again.stdout, again.stderr
    assert "not writable" not in again.stderr
    owners = {(st.st_uid, st.st_gid) for p in [root, ws.parent, *ws.parent.rglob("*")] for st in [os.lstat(p)]}
    assert owners == {(SERVING, SERVING)}
    take = python("-c", "import sys; from filelock import FileLock; FileLock(sys.argv[1], thread_local=False, "
                  "timeout=3).acquire()", lock, uid=SERVING, home=shared)
    assert take.returncode == 0, take.stderr


def test_prepare_follows_only_warmers_own_link_and_never_hands_over_what_is_above_the_root(shared):
    """A pod that owns its root (uid 1000, after the handover) replaces ROOT/flashinfer with a link
    elsewhere; the next fetch as root that does not swap the root (a miss, an error) prepares it:
    nothing above the root, nor through that link, is created or handed to the pod. Through the link
    warmer makes (workspace.link's), the shared workspace is handed over, and only it."""
    base = shared / "hostpath"
    root = base / "tiny"
    root.mkdir(parents=True)
    (root / restore.PREPARED).touch()
    os.chown(root, SERVING, SERVING)
    (root / "flashinfer").symlink_to(shared / "x")

    assert "does not exist" in restore.prepare(root, owner=(SERVING, SERVING))  # vLLM goes to a cold root
    assert os.stat(shared).st_uid == os.stat(base).st_uid == 0 and not (shared / "x").exists()

    (root / "flashinfer").unlink()
    (root / "flashinfer").symlink_to(workspace.target("0123456789abcdef"))
    assert restore.prepare(root, owner=(SERVING, SERVING)) is None
    top = base / workspace.SHARED / "0123456789abcdef"
    assert os.stat(top).st_uid == os.stat(top / workspace.WS).st_uid == SERVING
    assert os.stat(shared).st_uid == os.stat(base).st_uid == os.stat(top.parent).st_uid == 0


def test_prepare_follows_no_link_the_pod_planted_deeper_in_its_root(shared):
    """The same pod plants a link one level down, where FlashInfer's autotune directory lies
    (flashinfer/.cache): the fetch as root creates nothing through it, hands nothing behind it to
    the pod, and vLLM is told the directory is not there."""
    root = shared / "hostpath" / "tiny"
    (root / "flashinfer").mkdir(parents=True)
    (root / restore.PREPARED).touch()
    os.chown(root, SERVING, SERVING)
    elsewhere = shared / "elsewhere"
    (elsewhere / "flashinfer").mkdir(parents=True)  # a directory of that name, which the pod must not get
    (root / "flashinfer" / ".cache").symlink_to(elsewhere)

    assert "flashinfer/.cache/flashinfer/autotune does not exist" in restore.prepare(root, owner=(SERVING, SERVING))
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["flashinfer"]  # no autotune/ made through the link
    assert os.stat(elsewhere / "flashinfer").st_uid == os.stat(elsewhere).st_uid == 0
    assert os.stat(root / "vllm").st_uid == SERVING  # the rest of the root is prepared as before


def test_fetchs_env_file_does_not_take_vllm_back_into_a_root_it_cannot_write(node):
    """Both shipped start paths (the Deployment, the image's vllm-serve-warm) pass fetch's env file,
    which points every cache into the root: served by uid 1000 from a root-owned root, the cold
    root still wins for each of them (vLLM would crash on its lock files), the file's other values hold."""
    from warmer.components import cache_env

    root, env_file = node["base"] / "tiny", node["home"] / "vllm.env"
    out = warmer("fetch", node["recipe"], "--store", node["store"], "--root", root, "--env-file", env_file, "--require")
    assert out.returncode == 0, out.stderr
    assert f"VLLM_CACHE_ROOT={root / 'vllm'}\n" in env_file.read_text()
    env_file.write_text(env_file.read_text() + "WARMER_KEPT=from-the-file\n")
    cold = restore.cold_root(load(node["recipe"]).name, SERVING)

    served = warmer("serve", node["recipe"], "--root", root, "--env-file", env_file, "--dry-run", uid=SERVING,
                    home=node["home"])
    assert served.returncode == 0 and f"starts cold in {cold}" in served.stderr, served.stderr
    env = env_of(served)
    assert {var: env.get(var) for var in cache_env(cold)} == cache_env(cold)
    assert env["VLLM_CACHE_ROOT"] == str(cold / "vllm")
    assert not [v for v in env.values() if v.startswith(str(root))]  # nothing points into the root
    assert env["WARMER_KEPT"] == "from-the-file" and env["VLLM_USE_AOT_COMPILE"] == "0"
    shutil.rmtree(cold)
