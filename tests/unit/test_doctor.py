"""`warmer doctor` against recorded mountinfo samples: overlay root, hostPath, emptyDir, tmpfs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, make_cache_tree, tiny_recipe
from tests.fixtures import nodes
from warmer import components, doctor, mounts, restore, serving, workspace
from warmer.cli import doctor as doctor_cli
from warmer.envfile import EnvFile
from warmer.errors import UsageError

SAMPLES = REPO / "tests" / "fixtures" / "mountinfo"
POD_ENV = {"HOME": "/root", "PATH": "/usr/local/bin:/usr/bin:/bin", "HOSTNAME": "vllm-llama-3-1-8b-7d9f8c6b5-x2x7q"}
ROOT = "/cache/llama-3.1-8b-h200"


def sample(name: str) -> str:
    return (SAMPLES / f"{name}.txt").read_text()


def cache_env_under(root: str) -> dict:
    return {**POD_ENV, **components.cache_env(Path(root))}


def by(result: doctor.Diagnosis, **match) -> list[doctor.Finding]:
    return [f for f in result.findings if all(getattr(f, k) == v for k, v in match.items())]


def location(result: doctor.Diagnosis, var: str) -> dict:
    return next(r for r in result.locations if r["var"] == var)


# --- mountinfo parsing -----------------------------------------------------------------------

def test_parse_finds_fstype_after_the_separator_whatever_the_optional_fields():
    text = ("36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n"
            "37 35 98:0 / /a rw shared:2 master:3 propagate_from:4 - xfs /dev/sdb rw\n"
            "38 35 0:40 / /b rw - tmpfs tmpfs rw\n")
    found = mounts.parse_mountinfo(text)
    assert [(m.mount_point, m.root, m.fstype, m.source) for m in found] == [
        ("/mnt2", "/mnt1", "ext3", "/dev/root"), ("/a", "/", "xfs", "/dev/sdb"), ("/b", "/", "tmpfs", "tmpfs")]


def test_parse_decodes_octal_escapes_in_paths():
    text = r"40 1 259:2 /srv/fast\040disk/c\134d /mnt/my\040cache rw,relatime - ext4 /dev/nvme1n1 rw" + "\n"
    (m,) = mounts.parse_mountinfo(text)
    assert m.mount_point == "/mnt/my cache" and m.root == "/srv/fast disk/c\\d"
    assert mounts.mount_of("/mnt/my cache/vllm", [m]) is m
    assert mounts.mount_of("/mnt/my cachex", [m]) is None


def test_read_only_from_mount_or_superblock_options_but_not_remount_ro():
    found = mounts.parse_mountinfo(
        "1 0 8:1 / /a ro,relatime - ext4 /dev/sda1 rw\n"
        "2 0 8:2 / /b rw,relatime - ext4 /dev/sda2 ro\n"
        "3 0 8:3 / /c rw,relatime - ext4 /dev/sda3 rw,errors=remount-ro\n")
    assert [m.read_only for m in found] == [True, True, False]


def test_longest_mount_point_wins_and_a_later_mount_hides_an_earlier_one():
    found = mounts.parse_mountinfo(sample("hostpath") + "1600 1538 0:500 / /cache rw - tmpfs tmpfs rw\n")
    assert mounts.mount_of("/cache/x/vllm", found).fstype == "tmpfs"  # stacked on top
    assert mounts.mount_of("/cachex", found).mount_point == "/"
    assert mounts.mount_of("/models/llama", found).fstype == "xfs"


# --- the four samples ------------------------------------------------------------------------

def test_overlay_root_defaults_are_wiped_with_every_pod():
    result = doctor.diagnose(POD_ENV, sample("overlay-root"))
    vllm = location(result, "VLLM_CACHE_ROOT")
    assert vllm["path"] == "/root/.cache/vllm" and vllm["default"] and vllm["kind"] == "container-root"
    errors = by(result, severity="error", check="cache-location")
    assert {f.subject for f in errors} == set(doctor.PRIMARY)
    assert all("into a volume" in f.fix and "warmer fetch" in f.fix for f in errors)
    assert not result.ok
    # The secondary caches are warnings: seconds, not the compile itself.
    assert by(result, severity="warning", subject="CUDA_CACHE_PATH")


def test_hostpath_volume_holding_every_cache_is_clean():
    result = doctor.diagnose(cache_env_under(ROOT), sample("hostpath"))
    assert {r["kind"] for r in result.locations} == {"disk"}
    assert {r["mount_point"] for r in result.locations} == {"/cache"}
    assert result.ok and result.counts["warning"] == 0


def test_a_root_that_is_a_mount_point_is_an_error_as_fetch_refuses_it():
    """A volume mounted at the root itself: fetch and build refuse it (exit 2); doctor said 0 errors."""
    mounted_at_root = sample("hostpath") + f"1600 1538 259:3 / {ROOT} rw,relatime - ext4 /dev/nvme2n1 rw\n"
    [f] = by(doctor.diagnose(cache_env_under(ROOT), mounted_at_root, root=Path(ROOT)), check="root")
    assert f.severity == "error" and "is a mount point" in f.what and f"--root {ROOT}/RECIPE" in f.fix and "one level up (at /cache)" in f.fix
    assert not by(doctor.diagnose(cache_env_under(ROOT), sample("hostpath"), root=Path(ROOT)), check="root")


def test_emptydir_warns_when_nothing_fills_it_and_notes_it_when_an_artifact_is_active(tmp_path, active_root):
    result = doctor.diagnose(cache_env_under(ROOT), sample("emptydir"))
    assert location(result, "VLLM_CACHE_ROOT")["kind"] == "emptydir"
    warnings = by(result, severity="warning", check="cache-location")
    assert warnings and all("not a new pod" in f.what and "init container" in f.fix for f in warnings)
    assert result.ok  # survives restarts: not an error

    root = active_root
    mountinfo = sample("emptydir").replace(" /cache ", f" {tmp_path} ")
    result = doctor.diagnose({**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}, mountinfo, root=root)
    assert location(result, "VLLM_CACHE_ROOT")["in_active_root"]
    assert not by(result, severity="warning", check="cache-location")
    assert by(result, severity="info", check="cache-location", subject="VLLM_CACHE_ROOT")


def test_tmpfs_counts_against_memory():
    result = doctor.diagnose(cache_env_under(ROOT), sample("tmpfs"))
    assert location(result, "TRITON_CACHE_DIR")["kind"] == "tmpfs"
    found = by(result, check="cache-location", subject="VLLM_CACHE_ROOT")
    assert len(found) == 1 and found[0].severity == "warning" and "memory" in found[0].what


def test_env_file_vars_override_defaults_per_cache():
    # Only vLLM's root is moved: the others stay on the overlay and are still reported.
    env = {**POD_ENV, "VLLM_CACHE_ROOT": "/cache/m/vllm"}
    result = doctor.diagnose(env, sample("hostpath"))
    assert location(result, "VLLM_CACHE_ROOT")["kind"] == "disk"
    assert {f.subject for f in by(result, severity="error")} == set(doctor.PRIMARY) - {"VLLM_CACHE_ROOT"}


def test_inductor_default_follows_tmpdir_and_user():
    env = {**POD_ENV, "TMPDIR": "/cache/tmp"}
    result = doctor.diagnose(env, sample("hostpath"), user="vllm")
    assert location(result, "TORCHINDUCTOR_CACHE_DIR")["path"] == "/cache/tmp/torchinductor_vllm"
    assert location(result, "TORCHINDUCTOR_CACHE_DIR")["kind"] == "disk"


def test_network_filesystem_is_a_warning():
    text = sample("overlay-root") + "1600 1538 0:77 / /cache rw,relatime - nfs4 fs-1.efs.example:/ rw,vers=4.1\n"
    result = doctor.diagnose(cache_env_under(ROOT), text)
    assert location(result, "VLLM_CACHE_ROOT")["kind"] == "network"
    assert by(result, severity="warning", subject="FLASHINFER_WORKSPACE_BASE")
    assert result.ok


# --- FlashInfer's writable directories ---------------------------------------------------------

def test_read_only_flashinfer_workspace_is_an_error():
    text = sample("hostpath").replace("/var/cache/warmer /cache rw,relatime", "/var/cache/warmer /cache ro,relatime")
    result = doctor.diagnose(cache_env_under(ROOT), text)
    fi = by(result, check="flashinfer-writable", subject="FLASHINFER_WORKSPACE_BASE")
    assert fi and fi[0].severity == "error" and "import fails" in fi[0].what
    assert not result.ok


def test_flashinfer_dirs_outside_the_root_are_checked_with_this_machines_permissions():
    env = {**cache_env_under(ROOT), "FLASHINFER_CUBIN_DIR": "/opt/cubins"}
    result = doctor.diagnose(env, sample("hostpath"), can_write=lambda p: not p.startswith("/opt"))
    cubin = by(result, check="flashinfer-writable", subject="FLASHINFER_CUBIN_DIR")
    assert cubin and cubin[0].severity == "warning" and "downloaded" in cubin[0].what
    assert not by(result, check="flashinfer-writable", subject="FLASHINFER_WORKSPACE_BASE")


def test_a_pod_without_a_home_is_not_warned_of_the_moe_ep_knob_cache_vllm_only_reads():
    """An image's USER 1000 with no passwd entry gets HOME=/: FlashInfer's MoE-EP knob cache would
    default to /.cache/flashinfer, but only the offline tuner writes it; every start was warned."""
    env = {**cache_env_under(ROOT), "HOME": "/"}
    result = doctor.diagnose(env, sample("hostpath"), can_write=lambda p: p.startswith(ROOT))
    assert not by(result, check="flashinfer-writable"), result.findings


def test_flashinfer_workspace_is_only_a_warning_where_flashinfer_is_not_installed():
    text = sample("hostpath").replace("/var/cache/warmer /cache rw,relatime", "/var/cache/warmer /cache ro,relatime")
    result = doctor.diagnose(cache_env_under(ROOT), text, flashinfer_installed=False)
    assert by(result, check="flashinfer-writable", subject="FLASHINFER_WORKSPACE_BASE")[0].severity == "warning"


# --- env values that change vLLM's compile key per pod ---------------------------------------------

def test_kubernetes_service_links_of_a_vllm_service_are_not_per_pod_findings():
    """The shipped Deployment's Service vllm-llama-3-1-8b: Kubernetes puts its address in every pod
    as VLLM_LLAMA_3_1_8B_SERVICE_HOST and friends, which vLLM does not know and so never hashes;
    doctor warned of each on every pod. An unknown VLLM_* variable holding an IP is still said."""
    links = {"VLLM_LLAMA_3_1_8B_SERVICE_HOST": "10.96.14.7", "VLLM_LLAMA_3_1_8B_SERVICE_PORT": "8000",
             "VLLM_LLAMA_3_1_8B_SERVICE_PORT_HTTP": "8000", "VLLM_LLAMA_3_1_8B_PORT": "tcp://10.96.14.7:8000",
             "VLLM_LLAMA_3_1_8B_PORT_8000_TCP": "tcp://10.96.14.7:8000",
             "VLLM_LLAMA_3_1_8B_PORT_8000_TCP_ADDR": "10.96.14.7"}
    result = doctor.diagnose({**cache_env_under(ROOT), **links, "VLLM_MY_PORTAL_ADDR": "10.0.0.9"}, sample("hostpath"))
    assert [f.subject for f in by(result, check="per-pod-env")] == ["VLLM_MY_PORTAL_ADDR"]


def test_pod_ip_in_a_hashed_var_is_an_error_and_ignored_vars_are_fine():
    env = {**cache_env_under(ROOT), "VLLM_P2P_SIDE_CHANNEL_HOST": "10.42.3.17", "VLLM_HOST_IP": "10.42.3.17",
           "VLLM_PORT": "8000", "VLLM_DP_MASTER_IP": "10.42.0.5"}
    result = doctor.diagnose(env, sample("hostpath"))
    per_pod = by(result, check="per-pod-env")
    assert [(f.severity, f.subject) for f in per_pod] == [("error", "VLLM_P2P_SIDE_CHANNEL_HOST")]
    assert "never hits the cache" in per_pod[0].what and "unset" in per_pod[0].fix
    assert not result.ok


def test_hostname_in_an_unknown_vllm_var_and_the_historical_nixl_host_are_warnings():
    env = {**cache_env_under(ROOT), "VLLM_MY_PLUGIN_ID": POD_ENV["HOSTNAME"],
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.42.3.17", "NOT_VLLM": "10.42.3.17"}
    result = doctor.diagnose(env, sample("hostpath"))
    found = {f.subject: f for f in by(result, check="per-pod-env")}
    assert set(found) == {"VLLM_MY_PLUGIN_ID", "VLLM_NIXL_SIDE_CHANNEL_HOST"}
    assert all(f.severity == "warning" for f in found.values())
    assert "hostname" in found["VLLM_MY_PLUGIN_ID"].what
    assert result.ok


def test_bundle_indices_fragment_the_cache_even_with_a_stable_value():
    result = doctor.diagnose({**cache_env_under(ROOT), "VLLM_RAY_BUNDLE_INDICES": "0,1"}, sample("hostpath"))
    (f,) = by(result, check="per-pod-env")
    assert f.severity == "warning" and "bundle" in f.what


# --- the active artifact ---------------------------------------------------------------------

@pytest.fixture
def active_root(tmp_path, packed):
    """A node root with an artifact of the tiny recipe restored in it."""
    root = tmp_path / "node-root"
    restore.restore_file(packed("a").path, root)
    return root


def test_active_artifact_in_use_and_fitting_is_clean(tmp_path, active_root):
    root = active_root
    art = restore.active(root).artifact
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}
    result = doctor.diagnose(env, sample("hostpath").replace(" /cache ", f" {tmp_path} "), root=root,
                             node=lambda: art.fingerprint)
    assert result.root == str(root)
    assert not [f for f in result.findings if f.check in ("artifact", "fit") and f.severity != "info"]
    # The root is found from VLLM_CACHE_ROOT when not given.
    again = doctor.diagnose(env, sample("hostpath"))
    assert again.root == str(root)


def test_env_that_misses_the_root_or_the_recipe_env_is_an_error(tmp_path, active_root):
    root = active_root
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}
    del env["VLLM_USE_AOT_COMPILE"]
    env["TRITON_CACHE_DIR"] = "/root/.triton/cache"
    result = doctor.diagnose(env, sample("hostpath"), root=root)
    errors = {f.subject: f for f in by(result, severity="error", check="artifact")}
    assert set(errors) == {"VLLM_USE_AOT_COMPILE", "TRITON_CACHE_DIR"}
    assert "env file" in errors["TRITON_CACHE_DIR"].fix


def test_artifact_that_does_not_fit_this_node_is_an_error(tmp_path, active_root):
    root = active_root
    built = restore.active(root).artifact.fingerprint
    other = nodes.edit(built, machine="aarch64" if built.machine != "aarch64" else "x86_64")
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}
    result = doctor.diagnose(env, sample("hostpath"), root=root, node=lambda: other)
    (fit,) = by(result, check="fit")
    assert fit.severity == "error" and "machine" in fit.what and "warmer fetch" in fit.fix


def test_path_contract_against_the_served_recipe(tmp_path, active_root):
    root = active_root
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}
    result = doctor.diagnose(env, sample("hostpath"), root=root, recipe=tiny_recipe("/models/elsewhere"))
    contract = by(result, check="path-contract")
    assert contract and "/models/elsewhere" in contract[0].what and "/models/tiny" in contract[0].fix
    # Without a recipe: the built model path must exist here.
    result = doctor.diagnose(env, sample("hostpath"), root=root, exists=lambda p: False)
    assert by(result, check="path-contract", subject="/models/tiny")


def test_root_without_an_artifact_says_where_to_look(tmp_path):
    result = doctor.diagnose(cache_env_under(str(tmp_path)), sample("hostpath"), root=tmp_path)
    (f,) = by(result, check="artifact")
    assert f.severity == "warning" and "kubectl logs" in f.fix and "warmer-fetch" in f.fix


def test_the_report_keeps_each_name_apart_from_its_value_and_never_says_none(active_root):
    # Nothing points into the root: every cache var is unset, so the findings quote unset values.
    result = doctor.diagnose(dict(POD_ENV), sample("overlay-root"), root=active_root)
    text = doctor_cli.report(result)
    assert "None" not in text and "VLLM_CACHE_ROOT is unset, not " in text, text
    lines = text.splitlines()
    assert lines[1].split() == ["VARIABLE", "PATH", "FILESYSTEM"]
    longest = max(len(row["var"]) for row in result.locations)
    for row in result.locations:
        [line] = [ln for ln in lines if ln.startswith(f"  {row['var']} ")]
        # every value starts in the same column, two spaces past the longest name
        assert line[2 + longest:4 + longest] == "  " and line[4 + longest:].startswith(row["path"]), line


# --- the command line ----------------------------------------------------------------------

def _doctor_cli(tmp_path, mountinfo: str, env_file_env: dict, *extra) -> subprocess.CompletedProcess:
    env_file = tmp_path / "vllm.env"
    env_file.write_text(EnvFile.of(env_file_env).render("dotenv"))
    proc_env = {**POD_ENV, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "warmer", "doctor", "--mountinfo", str(SAMPLES / f"{mountinfo}.txt"),
                           "--env-file", str(env_file), *extra], capture_output=True, text=True, env=proc_env,
                          cwd=REPO)


def test_cli_exits_non_zero_only_with_errors(tmp_path):
    bad = _doctor_cli(tmp_path, "overlay-root", {"HF_HUB_OFFLINE": "1"}, "--json")
    assert bad.returncode == 5, bad.stderr
    doc = json.loads(bad.stdout)
    assert doc["counts"]["error"] == len(doctor.PRIMARY)

    good = _doctor_cli(tmp_path, "hostpath", components.cache_env(Path(ROOT)))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "0 error(s)" in good.stdout and "disk: ext4 on /cache" in good.stdout

    warn = _doctor_cli(tmp_path, "emptydir", components.cache_env(Path(ROOT)))
    assert warn.returncode == 0 and "WARNING" in warn.stdout and "fix:" in warn.stdout


def _running(env: dict) -> subprocess.Popen:
    """A process that stands in for vLLM, returned once it runs: Popen returns inside the child's
    execve, where /proc/PID/environ still reads empty."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert child.stdout.readline() == b"up\n"
    return child


def test_cli_reads_the_env_of_a_process(tmp_path):
    child = _running({**POD_ENV, **components.cache_env(Path(ROOT)), "VLLM_P2P_SIDE_CHANNEL_HOST": "10.42.3.17"})
    try:
        out = subprocess.run([sys.executable, "-m", "warmer", "doctor", "--pid", str(child.pid), "--mountinfo",
                              str(SAMPLES / "hostpath.txt"), "--json"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    finally:
        child.communicate(b"")
    doc = json.loads(out.stdout)
    assert [f["subject"] for f in doc["findings"] if f["severity"] == "error"] == ["VLLM_P2P_SIDE_CHANNEL_HOST"]
    assert out.returncode == 5


def test_a_process_that_exited_or_shows_no_env_is_said_not_judged():
    """Judging an empty env as vLLM's would report every cache variable unset: a process that exited
    (a zombie here), or one with no environment (as one inside its execve shows), is said instead."""
    gone = subprocess.Popen(["true"])
    os.waitid(os.P_PID, gone.pid, os.WEXITED | os.WNOWAIT)  # exited, unreaped: the pid stays its own
    try:
        with pytest.raises(UsageError, match=f"process {gone.pid} has exited.*--env-file"):
            doctor.diagnose_here(pid=gone.pid)
    finally:
        gone.wait()
    with pytest.raises(UsageError, match=f"process {gone.pid} has exited"):  # reaped now
        doctor.diagnose_here(pid=gone.pid)
    bare = _running({})
    try:
        with pytest.raises(UsageError, match=f"process {bare.pid} shows no environment.*--env-file"):
            doctor.diagnose_here(pid=bare.pid)
    finally:
        bare.communicate(b"")


@pytest.mark.parametrize("text", ["", "garbage line\n", "1 2 3\n"])
def test_unparseable_lines_are_skipped(text):
    assert mounts.parse_mountinfo(text) == []


# --- a root fetch prepared after a miss; the shared FlashInfer workspace of a baked root ----------------

def test_a_root_prepared_after_a_miss_is_found_from_the_env_and_said_as_with_root(tmp_path):
    """`kubectl exec ... warmer doctor --pid 1` in a pod whose fetch missed: the env points into a root
    fetch prepared for a cold start; doctor must say no artifact is active, not report an all-clear."""
    root = tmp_path / "root"
    restore.prepare(root)
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), root).vars}
    mountinfo = sample("hostpath").replace(" /cache ", f" {tmp_path} ")
    found = doctor.diagnose(env, mountinfo)
    assert found.root == str(root)
    (f,) = by(found, check="artifact")
    assert f.severity == "warning" and "no warmer artifact is active" in f.what
    assert found.findings == doctor.diagnose(env, mountinfo, root=root).findings
    # A directory warmer did not prepare is not taken for a root.
    (root / restore.PREPARED).unlink()
    assert doctor.diagnose(env, mountinfo).root is None


KEY = "0123456789abcdef"  # a workspace key, as workspace.key() names one


@pytest.fixture
def baked_root(tmp_path, packed):
    """An active root at BASE/tiny whose flashinfer/ is warmer's link to BASE/.flashinfer/KEY/ws."""
    root = tmp_path / "base" / "tiny"
    restore.restore_file(packed("a").path, root)
    (root.parent / ".flashinfer" / KEY / "ws").mkdir(parents=True)
    shutil.rmtree(root / "flashinfer")  # the cache directories restore made in it (none holds a file)
    (root / "flashinfer").symlink_to(workspace.target(KEY))
    return root


def test_the_shared_flashinfer_workspace_of_a_baked_root_is_baked_with_it(baked_root):
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), baked_root).vars}
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(baked_root.parent / ".flashinfer" / KEY / "ws")
    result = doctor.diagnose(env, sample("overlay-root"), root=baked_root)
    fi = by(result, check="cache-location", subject="FLASHINFER_WORKSPACE_BASE")
    assert [f.severity for f in fi] == ["info"] and "shared FlashInfer workspace" in fi[0].what, fi
    assert location(result, "FLASHINFER_WORKSPACE_BASE")["in_active_root"]
    assert result.ok and not by(result, check="cache-location", severity="warning")


def test_a_workspace_that_is_not_warmers_link_or_not_on_the_roots_mount_is_still_reported(baked_root):
    env = {**POD_ENV, **serving.vllm_env(tiny_recipe(), baked_root).vars}
    # The root on a volume of its own, the workspace beside it on the container's overlay: wiped.
    volume = sample("overlay-root") + f"1600 1538 259:1 /x {baked_root} rw,relatime - ext4 /dev/nvme0n1p1 rw\n"
    result = doctor.diagnose(env, volume, root=baked_root)
    assert [f.severity for f in by(result, subject="FLASHINFER_WORKSPACE_BASE")] == ["error"]
    # Another link than warmer's (an absolute one here) says nothing of where it points.
    (baked_root / "flashinfer").unlink()
    (baked_root / "flashinfer").symlink_to(baked_root.parent / ".flashinfer" / KEY / "ws")
    result = doctor.diagnose(env, sample("overlay-root"), root=baked_root)
    assert [f.severity for f in by(result, subject="FLASHINFER_WORKSPACE_BASE")] == ["error"]


def test_doctor_pid_judges_the_fit_for_the_gpus_the_process_was_given(tmp_path, monkeypatch):
    """A node whose GPUs differ, vLLM on its two H100s (CUDA_VISIBLE_DEVICES by UUID), doctor --pid
    from a shell without that variable: the fit is vLLM's GPUs', not every GPU of the node. NVML
    cannot run here: its answers recorded on such a node stand in (tests/fixtures/gpus)."""
    from warmer import fingerprint
    recorded = nodes.gpu_fixture("mixed-h100-l40s")["nvml"]
    monkeypatch.setattr(fingerprint, "_gpus_nvml", lambda: (fingerprint.read_nvml(nodes.FakeNVML(recorded)), ""))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    h100s = ",".join(d["nvmlDeviceGetUUID"] for d in recorded["devices"] if "H100" in d["nvmlDeviceGetName"])
    recipe = tiny_recipe(tensor_parallel_size=2)
    built = fingerprint.probe(model=recipe.model, gpu_env={"CUDA_VISIBLE_DEVICES": h100s})
    assert built.gpu.count == 2 and not built.gpu.mixed and fingerprint.probe().gpu.mixed
    from warmer import build
    src, root = tmp_path / "src", tmp_path / "cache" / "tiny"
    make_cache_tree(src)
    build.pack_root(src, recipe, tmp_path / "a.tar.zst", fp=built)
    restore.restore_file(tmp_path / "a.tar.zst", root)
    env = {**os.environ, **serving.vllm_env(recipe, root).vars, "CUDA_VISIBLE_DEVICES": h100s}
    vllm = _running(env)  # stands in for vLLM, started with its env
    try:
        found = doctor.diagnose_here(root=str(root), pid=vllm.pid)
    finally:
        vllm.communicate(b"")
    assert not [f for f in found.findings if f.check == "fit" and f.severity != "info"], found.findings

