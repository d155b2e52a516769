"""The operator's own mistakes are loud (exit 2 on fetch too, a UsageError from the API), and only
what lies past them (the network, the store's contents, the disk) is a miss. After a refused or
failed restore, the env describes no artifact: a slow start never turns into a failed one."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_warmer, tiny_recipe, write_tiny_recipe
from warmer import api, build, fetch
from warmer.components import flashinfer
from warmer.errors import UsageError
from warmer.store import blob_path, open_store

BAD_STORES = ["http://example.com/warmer", "gs://bucket/warmer", "s3://", "s3:///prefix", "file://relative/dir",
              "relative/dir", "oci://registry.example.com:5000", "oci://", ""]


@pytest.mark.parametrize("url", BAD_STORES)
def test_a_malformed_store_url_is_a_usage_error_on_fetch(url, tmp_path):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    out = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root")
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "store" in out.stderr.lower() and "Traceback" not in out.stderr
    assert not (tmp_path / "root").exists()  # nothing prepared for a fetch that never was
    with pytest.raises(UsageError):
        api.fetch(tiny_recipe(), url, tmp_path / "root")


@pytest.mark.parametrize(("var", "url"), [("WARMER_FETCH_WINDOW_MIB", "s3://bucket/warmer"),
                                          ("WARMER_OCI_MAX_ATTEMPTS", "oci://127.0.0.1:1/team/caches"),
                                          ("WARMER_OCI_CHUNK_MIB", "oci://127.0.0.1:1/team/caches")])
def test_a_typo_in_a_node_setting_of_the_store_is_a_usage_error_before_anything_is_read(var, url, tmp_path):
    """`64MiB` where a number of MiB goes: raised inside the restore, it was an "error" status and
    exit 0 on every fetch of every pod (a cold start forever); nothing listens on the store's port."""
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    endpoint = ["--endpoint-url", "http://127.0.0.1:1"] if url.startswith("s3://") else []
    out = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root", *endpoint,
                     env={**os.environ, var: "64MiB"})
    assert out.returncode == 2 and f"{var}='64MiB'" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "root").exists()


def test_values_from_mounted_files_and_empty_configmap_keys_read_as_operators_mean_them(tmp_path, packed,
                                                                                         monkeypatch):
    """WARMER_ROOT and WARMER_STORE read from a mounted Secret or ConfigMap file end in a newline: the
    fetch restored into a directory named "root\\n" and looked for the store "store\\n" (a miss). A
    variable set blank (an optional ConfigMap key) is unset, as it is for every other variable: the
    download window and the OCI settings failed the init container with exit 2."""
    from warmer.store.oci import client

    store = tmp_path / "store"
    build.publish(open_store(f"file://{store}"), packed("a").path)
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    env = {**os.environ, "WARMER_ROOT": f"{tmp_path / 'root'}\n", "WARMER_STORE": f"file://{store}\n",
           "WARMER_FETCH_WINDOW_MIB": "", "WARMER_OCI_MAX_ATTEMPTS": " ", "WARMER_DEADLINE": "60\n",
           "WARMER_OWNER": ""}
    out = run_warmer("fetch", recipe, "--require", "--json", env=env)
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "hit", out.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("root")] == ["root"]
    monkeypatch.setenv(client.ATTEMPTS_ENV, "")
    monkeypatch.setenv(client.CHUNK_ENV, "\n")
    assert client._env_int(client.ATTEMPTS_ENV, 8) == 8 and client._env_int(client.CHUNK_ENV, 5) == 5


def test_an_env_file_in_a_directory_that_is_not_there_is_a_usage_error_before_the_fetch(tmp_path, packed):
    """`--env-file /run/warmer-typo/vllm.env`: found when the file was written, after the download and
    the restore, it failed the init container (exit 1) on every restart, its root warmed each time."""
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a").path)
    recipe, typo = write_tiny_recipe(tmp_path / "tiny.toml"), tmp_path / "typo" / "vllm.env"
    for args in (["fetch", recipe, "--store", store.url], ["restore", packed("a").path]):
        out = run_warmer(*args, "--root", tmp_path / "root", "--env-file", typo)
        assert out.returncode == 2 and f"--env-file {typo}: {typo.parent} is not a directory" in out.stderr, out.stderr
        assert not (tmp_path / "root").exists()


def test_a_trusted_key_that_cannot_be_read_is_a_usage_error_even_on_a_miss(tmp_path):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    (tmp_path / "store").mkdir()
    out = run_warmer("fetch", recipe, "--store", f"file://{tmp_path / 'store'}", "--root", tmp_path / "root",
                     "--trusted-key", tmp_path / "no-such.pem")
    assert out.returncode == 2 and "no-such.pem" in out.stderr, out.stderr


def test_a_file_store_that_does_not_exist_is_said_not_read_as_empty(tmp_path):
    missing = f"file://{tmp_path / 'not-mounted'}"
    got = api.fetch(tiny_recipe(), missing, tmp_path / "root")
    assert got.status == "miss" and any("does not exist" in w for w in got.warnings), got.warnings
    out = run_warmer("ls", "--store", missing)
    assert out.returncode == 1 and "does not exist" in out.stderr, out.stderr


CUBIN = f"{flashinfer.CUBINS}abc/fmha/kernel.cubin"


@pytest.fixture
def with_cubins(tmp_path, packed):
    """A published artifact whose warm-up downloaded a cubin: its env points FlashInfer at them."""
    store = open_store(f"file://{tmp_path / 'store'}")
    result = build.publish(store, packed("a", extra={CUBIN: b"\x7fELF cubin"}).path)
    return store, result


def test_a_restored_artifact_gets_its_cubin_dir_and_the_download_ban_offline(with_cubins, tmp_path):
    store, _ = with_cubins
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", offline=True)
    assert got.status == "hit"
    assert got.env["FLASHINFER_CUBIN_DIR"].endswith(flashinfer.CUBINS.rstrip("/"))
    assert got.env["FLASHINFER_NO_DOWNLOAD"] == "1"


def test_a_failed_restore_leaves_an_env_that_describes_no_artifact(with_cubins, tmp_path):
    store, result = with_cubins
    blob = store.base / blob_path(result.blob)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the store's copy is damaged: the restore is refused
    blob.write_bytes(bytes(data))
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "root", offline=True)
    assert got.status == "error", got.warnings
    assert "FLASHINFER_CUBIN_DIR" not in got.env and "FLASHINFER_NO_DOWNLOAD" not in got.env, got.env.vars
    assert any("FLASHINFER_NO_DOWNLOAD" in w and "not set" in w for w in got.warnings), got.warnings
    assert got.env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "root" / "inductor")  # vLLM still compiles there


def test_a_miss_never_bans_downloads_even_for_an_offline_recipe(tmp_path):
    (tmp_path / "store").mkdir()
    got = fetch.fetch(tiny_recipe(), f"file://{tmp_path / 'store'}", tmp_path / "root", offline=True)
    assert got.status == "miss" and "FLASHINFER_NO_DOWNLOAD" not in got.env


def test_a_file_store_keeps_the_fetchs_deadline(tmp_path):
    """A shared directory (NFS) can stall as a bucket can: the download is bounded by the same deadline."""
    from warmer.deadline import Deadline

    bound = Deadline(7)
    assert open_store(f"file://{tmp_path}", deadline=bound).deadline is bound
    assert open_store(str(tmp_path), deadline=bound).deadline is bound
    assert open_store(f"file://{tmp_path}").deadline is not open_store(f"file://{tmp_path}").deadline  # each its own


def test_a_node_probe_that_hangs_ends_within_the_deadline_as_a_miss(tmp_path, packed):
    """A wedged driver: nvidia-smi (and NVML) never answer. The probe ran before anything the deadline
    bounds, so a fetch with --deadline 3 took nvidia-smi's own 30 s timeout (NVML's: forever). The GPU
    tools here are stand-ins that hang: no GPU or driver is on this machine."""
    import time

    hang = tmp_path / "bin"
    hang.mkdir()
    (hang / "nvidia-smi").write_text("#!/bin/sh\nsleep 120\n")
    (hang / "nvidia-smi").chmod(0o755)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a").path)
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    env = {**os.environ, "PATH": f"{hang}:{os.environ['PATH']}"}
    t0 = time.monotonic()
    out = run_warmer("fetch", recipe, "--store", store.url, "--root", tmp_path / "root", "--deadline", "3", "--json",
                     env=env, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "miss", out.stderr
    assert "probing this node" in out.stderr and took < 3 + 4, (took, out.stderr)
    # fetch --all (the DaemonSet's round, the systemd unit) picks its recipes by the probe: the round fails, in time
    (tmp_path / "manifests" / "models").mkdir(parents=True)
    (tmp_path / "manifests" / "skus.toml").write_text(
        '[sku.cpu]\nruns_on = ["x"]\nnode_selector = { "kubernetes.io/arch" = "amd64" }\nimage = "i"\n')
    t0 = time.monotonic()
    run_all = run_warmer("fetch", "--all", tmp_path / "manifests", "--store", store.url, "--root-base",
                         tmp_path / "roots", "--deadline", "3", env=env, timeout=120)
    assert run_all.returncode == 1 and "probing this node" in run_all.stderr, run_all.stderr
    assert time.monotonic() - t0 < 3 + 4
    # and so does the operator's look at the node's roots (it ran until killed)
    t0 = time.monotonic()
    listed = run_warmer("ls", "--root-base", tmp_path, "--deadline", "3", env=env, timeout=120)
    assert listed.returncode == 1 and "probing this node" in listed.stderr, listed.stderr
    assert time.monotonic() - t0 < 3 + 4
