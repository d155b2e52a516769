"""A restore that cannot hurt a node: hostile archives, kill -9, concurrent restores, full disks,
read-only and unwritable roots, mutated artifacts. After each, the root holds the previous
complete cache or the new complete cache, never a mix, and nothing lands outside it."""

import errno
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zstandard

from tests.conftest import REPO
from warmer import archive, artifact, build, restore
from warmer.store import open_store
from warmer.archive import FileEntry
from warmer.errors import Terminated


def assert_complete(root: Path) -> str:
    """root holds exactly one artifact's files, each matching its manifest; returns its name."""
    marker = restore.active(root)
    assert marker, f"{root} has no active artifact"
    entries = marker.artifact.files.by_path()
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {restore.MARKER}
    assert on_disk == set(entries), on_disk ^ set(entries)
    for rel, e in entries.items():
        assert archive.sha256_file(root / rel) == e.sha256, rel
    return marker.artifact.timings["build"]["name"]


@pytest.fixture
def previous(tmp_path, packed):
    """A root that already holds a complete cache (artifact A)."""
    path = packed("A").path
    root = tmp_path / "node" / "root"
    restore.restore_file(path, root)
    return root


def _hostile(packed, tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], listed: list[FileEntry]) -> Path:
    """An archive with a valid artifact.json listing `listed`, and a body made by hand."""
    art = packed("base").artifact
    doc = art.to_json()
    doc["files"] = [e.to_dict() for e in listed]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    path = tmp_path / "hostile.tar.zst"
    path.write_bytes(archive.manifest_frame(artifact.canonical(doc)) + zstandard.ZstdCompressor().compress(raw.getvalue()))
    return path


def _reg(name: str, data: bytes = b"x", mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info, None


def _entry(name: str, data: bytes = b"x", mode: int = 0o644) -> FileEntry:
    return FileEntry(name, len(data), hashlib.sha256(data).hexdigest(), mode, 0)


HOSTILE = {
    "absolute path": ([_reg("/tmp/warmer-escape-abs")], [_entry("/tmp/warmer-escape-abs")], "absolute"),
    "dot-dot": ([_reg("inductor/../../escape-dotdot")], [_entry("inductor/../../escape-dotdot")], "'..'"),
    "symlink out": ([_special("inductor/evil", tarfile.SYMTYPE, "/etc/passwd")], [_entry("inductor/evil", b"")],
                    "symlink"),
    "hardlink out": ([_special("inductor/hl", tarfile.LNKTYPE, "/etc/passwd")], [_entry("inductor/hl", b"")],
                     "hardlink"),
    "char device": ([_special("inductor/dev", tarfile.CHRTYPE)], [_entry("inductor/dev", b"")], "device"),
    "fifo": ([_special("inductor/fifo", tarfile.FIFOTYPE)], [_entry("inductor/fifo", b"")], "FIFO"),
    "setuid member": ([_reg("inductor/suid.so", b"x", 0o4755)], [_entry("inductor/suid.so", b"x", 0o755)], "setuid"),
    "setuid in manifest": ([_reg("inductor/suid.so", b"x", 0o755)], [_entry("inductor/suid.so", b"x", 0o4755)],
                           "setuid"),
    "unlisted member": ([_reg("inductor/a.so"), _reg("inductor/extra.so")], [_entry("inductor/a.so")], "not listed"),
    "size differs": ([_reg("inductor/a.so", b"xx")], [_entry("inductor/a.so", b"x")], "bytes"),
    "digest differs": ([_reg("inductor/a.so", b"y")], [_entry("inductor/a.so", b"x")], "sha256 differs"),
    "duplicate member": ([_reg("inductor/a.so"), _reg("inductor/a.so")], [_entry("inductor/a.so")], "twice"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archives_are_refused_and_nothing_moves(tmp_path, previous, case, packed):
    members, listed, message = HOSTILE[case]
    path = _hostile(packed, tmp_path, members, listed)
    before = assert_complete(previous)
    beside = sorted(p.name for p in previous.parent.iterdir())  # the root and its lock
    with pytest.raises(restore.RestoreError, match=message):
        restore.restore_file(path, previous)
    assert assert_complete(previous) == before
    # Nothing beside the root (no staging left, no escape: inductor/../../x from the staging dir
    # beside the root lands there), nothing at the absolute path.
    assert sorted(p.name for p in previous.parent.iterdir()) == beside
    assert not Path("/tmp/warmer-escape-abs").exists()


def test_decompression_bomb_is_refused(tmp_path, previous, packed):
    """20 MB of pax header squeezed into a few KB: refused before it is all inflated."""
    info, data = _reg("inductor/a.so")
    info.pax_headers = {"comment": "x" * (20 << 20)}
    path = _hostile(packed, tmp_path, [(info, data)], [_entry("inductor/a.so")])
    assert path.stat().st_size < 1 << 20
    with pytest.raises(restore.RestoreError, match="inflates past"):
        restore.restore_file(path, previous)
    assert_complete(previous)


def test_size_limit_is_enforced(tmp_path, previous, packed):
    _p = packed("B")
    path, doc = _p.path, _p.artifact
    with pytest.raises(restore.RestoreError, match="over the limit"):
        restore.restore_file(path, previous, max_bytes=doc.total_bytes - 1)
    assert assert_complete(previous) == "A"


def test_mutated_artifacts_are_never_activated(tmp_path, previous, packed):
    path = packed("B").path
    data = path.read_bytes()
    rng = random.Random(5)
    bad = tmp_path / "mutated.tar.zst"
    for trial in range(40):
        mutated = bytearray(data)
        if trial % 4 == 3:
            mutated = mutated[: rng.randrange(1, len(data) - 1)]  # truncation
        else:
            pos = rng.randrange(len(data))
            mutated[pos] ^= 1 << rng.randrange(8)  # one bit flip
        bad.write_bytes(bytes(mutated))
        with pytest.raises(restore.RestoreError):
            restore.restore_file(bad, previous)
        assert restore.active(previous).artifact.timings["build"]["name"] == "A"
    assert assert_complete(previous) == "A"


RESTORE_SCRIPT = "import sys; from pathlib import Path; from warmer import restore; " \
                 "restore.restore_file(Path(sys.argv[1]), Path(sys.argv[2]))"


def test_kill_9_at_random_moments_leaves_a_complete_cache(tmp_path, previous, packed):
    # Big enough that extraction takes a while next to the interpreter's start: random bytes do
    # not compress.
    a = packed("A2", extra={"inductor/big.so": os.urandom(48 << 20)}).path
    b = packed("B2", extra={"inductor/big.so": os.urandom(48 << 20), "vllm/more.json": b"{}"}).path
    cmd = [sys.executable, "-c", RESTORE_SCRIPT]
    subprocess.run(cmd + [str(a), str(previous)], check=True, cwd=REPO)  # compiles what changed
    t0 = time.perf_counter()
    subprocess.run(cmd + [str(b), str(previous)], check=True, cwd=REPO)
    full = time.perf_counter() - t0
    rng = random.Random(9)
    interrupted = 0
    for trial in range(20):
        target = b if trial % 2 == 0 else a
        proc = subprocess.Popen(cmd + [str(target), str(previous)], cwd=REPO)
        time.sleep(rng.uniform(0, full * 1.2))  # fault injection at a random moment, not synchronisation
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += bool(list(previous.parent.glob(".root.staging-*")))
        assert assert_complete(previous) in ("A", "A2", "B2")
    assert interrupted >= 1, "no kill landed during an extraction: the test proved nothing"
    # The next restore cleans up after the crashes and succeeds.
    restore.restore_file(b, previous)
    assert assert_complete(previous) == "B2"
    assert not list(previous.parent.glob(".root.staging-*"))


def test_concurrent_restores_extract_once(tmp_path, packed):
    path = packed("B", extra={"inductor/big.so": os.urandom(8 << 20)}).path
    root = tmp_path / "shared" / "root"
    procs = [subprocess.Popen([sys.executable, "-m", "warmer", "restore", str(path), "--root", str(root), "--json"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(8)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["status"] for r in results) == ["already-active"] * 7 + ["restored"]
    assert assert_complete(root) == "B"
    t0 = time.perf_counter()
    assert restore.restore_file(path, root).status == "already-active"
    assert time.perf_counter() - t0 < 0.5


def test_write_failure_mid_extraction_keeps_the_previous_cache(tmp_path, previous, packed):
    """A real kernel-enforced write failure: RLIMIT_FSIZE makes the big file's write fail (EFBIG)."""
    path = packed("B", extra={"inductor/big.so": os.urandom(2 << 20)}).path
    script = ("import resource, signal, sys; from pathlib import Path; from warmer import restore\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
              "try:\n    restore.restore_file(Path(sys.argv[1]), Path(sys.argv[2]))\n"
              "except restore.RestoreError as e:\n    print(e); sys.exit(7)\n")
    out = subprocess.run([sys.executable, "-c", script, str(path), str(previous)], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 7, out.stderr
    assert "File too large" in out.stdout and "unchanged" in out.stdout
    assert assert_complete(previous) == "A"
    assert not list(previous.parent.glob(".root.staging-*"))


@pytest.fixture
def small_fs(tmp_path):
    """A real, small filesystem (tmpfs); skipped where this user may not mount one."""
    mounted = []

    def make(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_partial_hit_needs_room_for_its_components_alone(small_fs, packed):
    """Only the components that fit the node are written: the space check counted the whole
    artifact, and refused, on a nearly full disk, a restore that needed a fraction of it."""
    b = packed("B", extra={"triton/abc/big.cubin": os.urandom(3 << 20)})
    store = open_store(f"file://{b.path.parent / 'store'}")
    build.publish(store, b.path, layers=True)
    fs = small_fs("partial", "size=2m")
    kept = ("inductor", "inductor-headers", "vllm")
    got = restore.restore(b.artifact, None, fs / "root", components=kept,
                          open_layer=lambda layer: store.stream_blob(layer.sha256, layer.size))
    assert got.status == "restored" and not (fs / "root" / "triton" / "abc").exists()
    assert restore.active(fs / "root").components == kept


def test_a_read_only_root_is_said_so_not_blamed_on_its_owner(small_fs, packed):
    """A volume mounted read-only: the fix printed was to chown the root, which fails there too."""
    fs = small_fs("ro", "size=8m")
    restore.restore_file(packed("A").path, fs / "root")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    assert restore.unwritable(fs / "root") == f"{fs / 'root'} is on a read-only filesystem"
    assert "mounted read-only" in restore.ownership_fix(fs / "root", (1000, 1000))
    assert "chown" not in restore.ownership_fix(fs / "root", (1000, 1000))


def test_a_root_that_is_a_mount_point_is_refused_with_its_fix(tmp_path, small_fs, packed):
    """A volume mounted at the root itself (a PVC or `docker run -v vol:/cache/RECIPE`): the new root
    is built beside it and renamed into place, which a mount point refuses (EBUSY). Every fetch
    downloaded the whole artifact, then started cold, told to "see the error above" where there was
    none. Refused before any download, with the layout that works."""
    from warmer.errors import UsageError

    path = packed("A").path
    volume = small_fs("root", "size=8m")
    with pytest.raises(UsageError, match=f"root {volume} is a mount point") as refused:
        restore.restore_file(path, volume)
    assert f"mount the volume one level up (at {volume.parent})" in str(refused.value)
    assert f"--root {volume}/RECIPE" in str(refused.value)
    assert "one level up" not in restore.mount_point_fix(Path("/cache"))  # no pod mounts a volume at /
    assert not list(volume.iterdir()) and not list(tmp_path.glob(".root.staging-*"))
    out = subprocess.run([sys.executable, "-m", "warmer", "restore", str(path), "--root", str(volume)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "is a mount point" in out.stderr and "Traceback" not in out.stderr, out.stderr

    # A bind mount within one filesystem (os.path.ismount cannot tell it): the mount table can.
    bound = tmp_path / "bound"
    restore.restore_file(path, bound)
    subprocess.run(["mount", "--bind", str(bound), str(bound)], check=True)
    try:
        with pytest.raises(UsageError, match=f"root {bound} is a mount point"):
            restore.restore_file(packed("B").path, bound)
        assert assert_complete(bound) == "A"  # the previous cache, as it was
    finally:
        subprocess.run(["umount", "-l", str(bound)], check=False)

    # The volume moved one level up, as said, over the old one (left mounted, hidden): the root is a
    # directory of the new volume, whatever the mount table still lists at its path.
    stacked = small_fs("cache", "size=8m")
    (stacked / "tiny").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(stacked / "tiny")], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(stacked)], check=True)
    try:
        assert restore.restore_file(path, stacked / "tiny").status == "restored"
        from warmer import doctor  # and doctor, on this machine, says as fetch does
        live = doctor.diagnose({}, Path("/proc/self/mountinfo").read_text(errors="replace"), root=stacked / "tiny",
                               can_write=lambda _: True)
        assert not [f for f in live.findings if f.check == "root"], live.findings
    finally:
        subprocess.run(["umount", "-l", str(stacked)], check=False)
        subprocess.run(["umount", "-l", str(stacked / "tiny")], check=False)


def test_where_proc_gives_no_mount_id_the_mount_table_decides(tmp_path, small_fs, packed, monkeypatch):
    """gVisor's /proc/self/fdinfo has no mnt_id line: the mount table decides there. The kernel's
    answer is stood in for (no gVisor here); the mount is real."""
    from warmer.errors import UsageError

    volume = small_fs("root", "size=8m")
    monkeypatch.setattr(restore, "_mount_id", lambda path: None)
    with pytest.raises(UsageError, match="is a mount point"):
        restore.restore_file(packed("A").path, volume)
    assert restore.restore_file(packed("A").path, tmp_path / "plain").status == "restored"


def test_a_root_in_an_overlays_lower_layer_is_said_so(tmp_path, packed):
    """A root baked into an image (an overlay's lower layer, which Docker's overlay2 cannot rename:
    EXDEV) was blamed on "see the error above", then on a mount point that was not there."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    restore.restore_file(packed("A").path, lower / "cache" / "tiny")
    options = f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off"
    res = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount an overlay here: {res.stderr.decode().strip()}")
    try:
        root = merged / "cache" / "tiny"
        with pytest.raises(restore.RestoreError) as e:
            restore.restore_file(packed("B").path, root, force=True)
        assert "in an overlay's lower layer (a directory baked into the image)" in str(e.value), str(e.value)
        assert "is a mount point" not in str(e.value)
        assert assert_complete(root) == "A"
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=False)


def test_a_root_whose_name_holds_glob_characters_leaves_other_roots_staging_alone(tmp_path, packed):
    """A restore clears the staging directories a crash left beside its root, matched by name: a `[`
    in the name made the pattern match other roots' (`/cache/m[ab]` took `.ma.staging-*`, a running
    restore's), and never its own."""
    base = tmp_path / "cache"
    base.mkdir()
    others = base / ".ma.staging-0123456789ab"  # another root's restore, under way
    others.mkdir()
    own = base / ".m[ab].staging-aaaaaaaaaaaa"  # this root's, left by a crash
    own.mkdir()
    restore.restore_file(packed("A").path, base / "m[ab]")
    assert others.is_dir() and not own.exists()
    assert assert_complete(base / "m[ab]") == "A"


def test_sigterm_between_the_two_renames_of_a_swap_leaves_a_root(tmp_path, packed, monkeypatch):
    """Where renameat2's RENAME_EXCHANGE is refused (NFS: EINVAL; made so here) the swap is two
    renames. SIGTERM (the pod deleted) raised between them left no root at all, and the new tree,
    then at the staging path, was removed with it. Another thread is alive, as a download's readers
    are: the kernel may hand it the signal, whose handler then runs in the main thread all the same."""
    root = tmp_path / "root"
    restore.restore_file(packed("A").path, root)
    b = packed("B", extra={"inductor/b.so": b"b"}).path

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "Invalid argument")

    real = os.rename

    def rename(src, dst):
        real(src, dst)
        if Path(src) == root:  # the old tree moved aside: the moment a SIGTERM hurt
            os.kill(os.getpid(), signal.SIGTERM)

    def terminated(signum, frame):
        raise Terminated("SIGTERM")

    monkeypatch.setattr(restore, "_exchange", no_exchange)
    monkeypatch.setattr(restore.os, "rename", rename)
    before = signal.signal(signal.SIGTERM, terminated)
    done = threading.Event()
    reader = threading.Thread(target=done.wait)
    reader.start()
    try:
        with pytest.raises(Terminated):
            restore.restore_file(b, root)
    finally:
        done.set()
        reader.join()
        signal.signal(signal.SIGTERM, before)
        monkeypatch.undo()
    assert assert_complete(root) == "B"
    assert [p.name for p in tmp_path.iterdir() if ".staging-" in p.name] == []


def test_full_disk_keeps_the_previous_cache(tmp_path, small_fs, packed):
    a = packed("A").path
    b = packed("B", extra={"inductor/big.so": os.urandom(3 << 20)}).path
    # Too little room for B at all: refused before a byte is written, with the sizes.
    fs = small_fs("small", "size=2m")
    restore.restore_file(a, fs / "root")
    with pytest.raises(restore.RestoreError, match=r"unpacks to 3\.\d MB but .* has \d\.\d MB free"):
        restore.restore_file(b, fs / "root")
    assert assert_complete(fs / "root") == "A"
    # Room for the bytes but not for the files (inodes run out mid-extraction): ENOSPC.
    probe = small_fs("probe", "size=64m")
    restore.restore_file(a, probe / "root")
    st = os.statvfs(probe)
    used = st.f_files - st.f_ffree
    tight = small_fs("tight", f"size=64m,nr_inodes={used + 4}")
    restore.restore_file(a, tight / "root")
    with pytest.raises(restore.RestoreError, match="No space left"):
        restore.restore_file(b, tight / "root")
    assert assert_complete(tight / "root") == "A"
    assert not list(tight.glob(".root.staging-*"))


def test_a_sibling_file_that_grew_is_not_copied_onto_a_nearly_full_disk(tmp_path, small_fs, caplog):
    """Two roots on a small disk; a file of the first has grown past what it fits (anything on the node
    may append to it). The second root's fetch refuses that file on its size before copying a byte
    (copied whole, it filled the disk and its leftover failed the layer's download: "File exists"),
    downloads the layer instead, and fits."""
    from tests.conftest import tiny_recipe
    from tests.unit.test_layered_fetch import _pack
    from warmer import build, fetch
    from warmer.store import open_store

    out, art, files = _pack(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, out, layers=True)
    base = small_fs("small", "size=3m") / "cache"
    assert fetch.fetch(tiny_recipe(), store, base / "one").status == "hit"
    rel = "triton/AB3C/triton_poi_fused_0.cubin"
    with open(base / "one" / rel, "ab") as f:
        f.write(os.urandom(1_600_000))  # more than the disk has left
    caplog.set_level("INFO", logger="warmer")

    got = fetch.fetch(tiny_recipe(), store, base / "two")
    assert got.status == "hit", got.warnings
    assert "triton" not in got.restore.reused and (base / "two" / rel).read_bytes() == files[rel]
    assert f"{rel} is {len(files[rel]) + 1_600_000} bytes, artifact.json lists {len(files[rel])}" in caplog.text


def test_read_only_filesystem(tmp_path, small_fs, packed):
    a = packed("A").path
    b = packed("B").path
    fs = small_fs("ro", "size=16m")
    restore.restore_file(a, fs / "root")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    with pytest.raises(restore.RestoreError, match="read-only"):
        restore.restore_file(b, fs / "root")
    assert assert_complete(fs / "root") == "A"


def test_missing_permissions(tmp_path, packed):
    """Restoring as a user who may not write beside the root: a clear error, nothing changed."""
    a = packed("A").path
    b = packed("B").path
    base = Path(tempfile.mkdtemp(prefix="warmer-perm-"))  # pytest's tmp dirs are private to their owner
    try:
        base.chmod(0o755)
        restore.restore_file(a, base / "root")
        shutil.copy(b, base / "b.tar.zst")
        (base / "b.tar.zst").chmod(0o644)
        # Everything is imported first; then, if we are root (who ignores permissions), the
        # process drops to nobody, who may not write in base.
        script = ("import os, sys; from warmer import cli\n"
                  "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
                  "sys.exit(cli.main(sys.argv[1:]))\n")
        if os.geteuid() != 0:
            base.chmod(0o555)
        out = subprocess.run([sys.executable, "-c", script, "restore", str(base / "b.tar.zst"), "--root",
                              str(base / "root")], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 1, out.stderr
        assert "Permission denied" in out.stderr and "unchanged" in out.stderr and "Traceback" not in out.stderr
        assert assert_complete(base / "root") == "A"
    finally:
        base.chmod(0o755)
        shutil.rmtree(base)
