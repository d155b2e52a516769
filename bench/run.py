"""warmer against tar + zstd and the AWS CLI, side by side, on a synthetic cache tree.

For each tree size (default 1 GiB and a quarter of it) and each step, the median of --trials runs
of each side, interleaved (warmer, baseline, warmer, ...) so that a busy neighbour slows both:

    pack          warmer pack                      tar -cf - | zstd -T0 -LEVEL
    publish-file  warmer publish file://           cp && sync FILE
    restore-file  warmer fetch (file store)        zstd -d | tar -x
    no-op fetch   warmer fetch, already active     -
    publish-s3    warmer publish s3://             aws s3 cp FILE s3://
    restore-s3    warmer fetch (s3 store)          aws s3 cp s3:// FILE && tar --zstd -xf FILE

Then warmer alone, once, on the small tree's files made 4x bigger: peak memory against bytes.

Every command runs as its own process: wall time from start to exit, and peak RSS from wait4
(the largest process of a pipeline). S3 is moto's server on loopback. Each restore goes into a
new root, kept until the end of the run and dropped from the page cache once measured; `sync`
runs (untimed) before every timed command. Inputs stay in the page cache (--drop-caches: not).

    python bench/run.py [--size 1GiB] [--trials 3] [--workdir .bench] [--json FILE] [--no-s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree  # noqa: E402

HERE = Path(__file__).resolve().parent
RECIPE = HERE / "recipe.toml"
SUBDIRS = ("inductor", "vllm", "triton", "flashinfer")
BUCKET = "warmer-bench"
# Goals of issue 8: warmer's time over the baseline's, and the no-op fetch in seconds.
GOALS = {"pack": 1.0, "restore-file": 1.1, "restore-s3": 1.1}
NOOP_GOAL_S = 0.5
# "Does not grow": the same files with ~4x the bytes may add buffers, not data: at most this much.
RSS_GROWTH_GOAL = 16 << 20


class BenchError(Exception):
    pass


DROP_CACHES = False  # --drop-caches


# -- running and measuring --------------------------------------------------------------------

# Forks and times the command from a process of a few MiB: a child forked from this runner would
# start with its RSS high-water mark (Linux carries it across exec) and every peak would read as
# at least the runner's. Values below the launcher's own (~7 MiB) read as that floor.
LAUNCHER = """
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{time.perf_counter() - t0} {usage.ru_maxrss}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(cmd: list[str] | str, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run cmd (a list, or a bash pipeline) to completion: seconds, peak RSS, stdout."""
    argv = ["bash", "-o", "pipefail", "-c", cmd] if isinstance(cmd, str) else cmd
    subprocess.run(["sync"], check=True)
    if DROP_CACHES:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    with tempfile.NamedTemporaryFile("r") as usage:
        p = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCHER, usage.name, *argv], env=env, cwd=cwd,
                           capture_output=True, text=True, errors="replace")
        seconds, rss_kib = usage.read().split()
    if p.returncode != 0:
        shown = cmd if isinstance(cmd, str) else " ".join(cmd)
        raise BenchError(f"`{shown}` exited {p.returncode}:\n{p.stderr[-3000:]}")
    # ru_maxrss is in KiB on Linux; for a pipeline, that of its largest process.
    return {"seconds": float(seconds), "rss": int(rss_kib) * 1024, "stdout": p.stdout}


WARMER_SRC: str | None = None  # --warmer-src: another checkout's warmer (a before/after comparison)


def warmer(*args: str) -> list[str]:
    if WARMER_SRC:  # ahead of the current directory, which `python -m` puts first
        return [sys.executable, "-c", f"import runpy, sys; sys.path.insert(0, {WARMER_SRC!r}); "
                "runpy.run_module('warmer', run_name='__main__', alter_sys=True)", *args]
    return [sys.executable, "-m", "warmer", *args]


def evict(root: Path) -> None:
    """Write a restored root back and drop it from the page cache: every trial then starts with
    the same free memory, not with the page cache the trials before it filled."""
    os.sync()
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def rmtree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        p.unlink()


def summarize(runs: list[dict]) -> dict:
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "rss": int(statistics.median(r["rss"] for r in runs)),
            "trials_s": [round(r["seconds"], 3) for r in runs]}


def pair(trials: int, warmer_run, baseline_run=None) -> dict:
    """Interleave the two sides, trial by trial; each run(i, last) cleans up after itself."""
    w, b = [], []
    for i in range(trials):
        w.append(warmer_run(i, i == trials - 1))
        if baseline_run:
            b.append(baseline_run(i, i == trials - 1))
    out = {"warmer": summarize(w)}
    if b:
        out["baseline"] = summarize(b)
        out["ratio"] = out["warmer"]["seconds"] / out["baseline"]["seconds"]
    return out


# -- S3 on loopback ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(workdir: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise BenchError(f"moto server exited {proc.returncode}: see {workdir / 'moto.log'}")
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError(f"moto server did not answer on {url} in 30 s")
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def aws_env(workdir: Path, endpoint: str) -> dict:
    """Dummy credentials and the loopback endpoint; no AWS config of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="AKIDWARMERBENCH", AWS_SECRET_ACCESS_KEY="warmer-bench-secret",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(workdir / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(workdir / "no-aws-credentials"))
    return env


# -- one tree size ----------------------------------------------------------------------------

def bench_size(size: int, args, aws: str | None, scale: int = 1, baseline: bool = True) -> dict:
    """Every step on a tree of this size; scale > 1: the same files with bigger binaries, and
    warmer alone, once (for peak memory)."""
    wd: Path = args.workdir
    tree_label = f"{size >> 20}MiB" + (f"-x{scale}" if scale > 1 else "")
    root = wd / f"tree-{tree_label}"
    t0 = time.perf_counter()
    info = tree.generate(root, size, args.seed, scale)
    print(f"tree {root}: {info['files']} files, {tree.human(info['bytes'])} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    level = str(args.level)
    w_art, b_art = wd / "warmer.tar.zst", wd / "baseline.tar.zst"
    res: dict = {"size": size, "scale": scale, "tree_files": info["files"], "tree_bytes": info["bytes"]}
    steps = res["steps"] = {}
    n = args.trials if baseline else 1

    def base(run):
        return run if baseline else None

    def say(name: str) -> None:
        s = steps[name]
        line = f"  {name}: warmer {s['warmer']['trials_s']}"
        if "baseline" in s:
            line += f", baseline {s['baseline']['trials_s']}, ratio {s['ratio']:.2f}"
        print(line, file=sys.stderr)

    # Archives are removed as soon as they are measured, before the kernel writes them back.
    # Restored roots are kept until the whole run is over: creating thousands of files right
    # after deleting thousands is slow on some filesystems (ext4 without a journal skips inodes
    # deleted in the last minutes), and no trial should pay for the one before.
    def w_pack(i, last):
        rmtree(w_art)
        r = measure(warmer("pack", str(root), "--recipe", str(RECIPE), "-o", str(w_art), "--level", level, "--json"))
        packed = json.loads(r["stdout"])
        res.update(files=packed["files"], bytes=packed["bytes"], warmer_archive_bytes=w_art.stat().st_size)
        if not last:
            rmtree(w_art)
        return r

    def b_pack(i, last):
        r = measure(f"tar -C {root} -cf - {' '.join(SUBDIRS)} | zstd -q -T0 -{level} -o {b_art}")
        res["baseline_archive_bytes"] = b_art.stat().st_size
        rmtree(b_art)
        return r

    steps["pack"] = pair(n, w_pack, base(b_pack))
    say("pack")

    # publish to a file store (the last one stays, to restore from), then restore from it
    store = wd / "store"
    rmtree(store)

    def w_pub(i, last):
        r = measure(warmer("publish", str(w_art), "--store", f"file://{store}", "--json"))
        if not last:
            rmtree(store)
        return r

    def b_pub(i, last):
        r = measure(["bash", "-c", 'cp "$0" "$1" && sync "$1"', str(w_art), str(wd / "copy.tar.zst")])
        rmtree(wd / "copy.tar.zst")
        return r

    steps["publish-file"] = pair(n, w_pub, base(b_pub))
    say("publish-file")
    blob = next(store.glob("blobs/sha256/*/*.tar.zst"))

    def new_root(label: str) -> Path:
        p = wd / "roots" / f"{tree_label}-{label}"
        rmtree(p)
        p.parent.mkdir(exist_ok=True)
        return p

    def done(root_: Path, keep: bool = False) -> None:
        if args.discard_roots and not keep:
            rmtree(root_)
        else:
            evict(root_)

    def fetch(store_url: str, root_: Path, env=None, expect="hit", keep=False):
        r = measure(warmer("fetch", str(RECIPE), "--store", store_url, "--root", str(root_), "--json"), env=env)
        got = json.loads(r["stdout"])["status"]
        if got != expect:
            raise BenchError(f"warmer fetch from {store_url}: {got}, expected {expect}")
        done(root_, keep)
        return r

    def untar(cmd: str, root_: Path, env=None):
        root_.mkdir()
        r = measure(cmd.format(root=root_), env=env)
        done(root_)
        return r

    last_root = None

    def w_restore_file(i, last):
        nonlocal last_root
        last_root = new_root(f"file-warmer-{i}")
        return fetch(f"file://{store}", last_root, keep=last)  # the last one: for the no-op fetch

    steps["restore-file"] = pair(
        n, w_restore_file,
        base(lambda i, last: untar(f"zstd -q -d -c {blob} | tar -x -C {{root}}", new_root(f"file-baseline-{i}"))))
    say("restore-file")
    steps["noop-fetch"] = pair(n, lambda i, last: fetch(f"file://{store}", last_root, expect="already-active",
                                                         keep=not last))
    say("noop-fetch")
    rmtree(store)

    if aws:
        with moto_server(wd) as endpoint:
            env = aws_env(wd, endpoint)
            import boto3  # the bench's own venv has it: warmer depends on it
            s3 = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                                aws_access_key_id="x", aws_secret_access_key="x")
            s3.create_bucket(Bucket=BUCKET)

            def forget(prefix: str) -> None:  # moto holds objects in memory: keep only what is used
                for obj in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []):
                    s3.delete_object(Bucket=BUCKET, Key=obj["Key"])

            def w_pub_s3(i, last):
                r = measure(warmer("publish", str(w_art), "--store", f"s3://{BUCKET}/w{i}", "--json"), env=env)
                if i:
                    forget(f"w{i}/")
                return r

            def b_pub_s3(i, last):
                r = measure([aws, "s3", "cp", "--only-show-errors", str(w_art), f"s3://{BUCKET}/b{i}/a.tar.zst"],
                            env=env)
                if i:
                    forget(f"b{i}/")
                return r

            steps["publish-s3"] = pair(n, w_pub_s3, base(b_pub_s3))
            say("publish-s3")
            local = wd / "download.tar.zst"
            steps["restore-s3"] = pair(
                n, lambda i, last: fetch(f"s3://{BUCKET}/w0", new_root(f"s3-warmer-{i}"), env=env),
                base(lambda i, last: untar(f"{aws} s3 cp --only-show-errors s3://{BUCKET}/b0/a.tar.zst {local} "
                                           f"&& tar --zstd -xf {local} -C {{root}} && rm {local}",
                                           new_root(f"s3-baseline-{i}"), env=env)))
            say("restore-s3")
            forget("")
    rmtree(w_art)
    for s in steps.values():
        for side in ("warmer", "baseline"):
            if side in s:
                s[side]["mb_s"] = res["bytes"] / s[side]["seconds"] / 1e6
    return res


# -- the machine --------------------------------------------------------------------------------

def _first_line(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (r.stdout.strip() or r.stderr.strip()).splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def machine(workdir: Path, aws: str | None) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    dev, fstype = None, None
    best = ""
    for line in Path("/proc/mounts").read_text().splitlines():
        d, mnt, fs = line.split()[:3]
        if str(workdir.resolve()).startswith(mnt) and len(mnt) >= len(best):
            best, dev, fstype = mnt, d, fs
    du = shutil.disk_usage(workdir)

    def version(dist):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)

    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "disk": {"device": dev, "fs": fstype, "mount": best, "free_bytes": du.free},
            "python": platform.python_version(),
            "versions": {"warmer": version("warmer"), "zstandard": version("zstandard"), "boto3": version("boto3"),
                         "moto": version("moto"), "zstd": _first_line(["zstd", "--version"]),
                         "tar": _first_line(["tar", "--version"]),
                         "aws": _first_line([aws, "--version"]) if aws else None}}


# -- the table ------------------------------------------------------------------------------------

ROWS = [("pack", "pack", "tar -cf - | zstd -T0"), ("publish-file", "publish file://", "cp + fsync"),
        ("restore-file", "fetch file://", "zstd -d | tar -x"), ("noop-fetch", "fetch, already active", "-"),
        ("publish-s3", "publish s3://", "aws s3 cp (up)"), ("restore-s3", "fetch s3://", "aws s3 cp + tar --zstd -x")]


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def table(results: dict) -> str:
    out = []
    for r in results["sizes"]:
        steps = r["steps"]
        w_arc, b_arc = r["warmer_archive_bytes"], r["baseline_archive_bytes"]
        out.append(f"\n{tree.human(r['bytes'])} of cache in {r['files']} files; archive {_mib(w_arc)} "
                   f"(ratio {r['bytes'] / w_arc:.2f}x) vs tar+zstd {_mib(b_arc)} "
                   f"({r['bytes'] / r['baseline_archive_bytes']:.2f}x); median of {results['trials']}")
        out.append("| step | warmer s | MB/s | peak RSS | baseline | baseline s | MB/s | peak RSS "
                   "| warmer/baseline | goal |")
        out.append("|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
        for name, label, base in ROWS:
            s = steps.get(name)
            if s is None:
                out.append(f"| {label} | not run | | | {base} | | | | | |")
                continue
            w, b = s["warmer"], s.get("baseline")
            goal = ""
            if name in GOALS:
                goal = f"≤ {GOALS[name]:.1f}× {'met' if s['ratio'] <= GOALS[name] else 'MISSED'}"
            elif name == "noop-fetch":
                goal = f"< {NOOP_GOAL_S} s {'met' if w['seconds'] < NOOP_GOAL_S else 'MISSED'}"
            rate = "" if name == "noop-fetch" else f"{w['mb_s']:.0f}"
            row = [label, f"{w['seconds']:.2f}", rate, _mib(w["rss"]), base]
            row += ([f"{b['seconds']:.2f}", f"{b['mb_s']:.0f}", _mib(b["rss"]), f"{s['ratio']:.2f}"] if b
                    else ["", "", "", ""])
            out.append("| " + " | ".join(row + [goal]) + " |")
    mem = results.get("memory")
    if mem:
        t = results["memory_trees"]
        cols = [f"{tree.human(t[k]['bytes'])} in {t[k]['files']} files" for k in ("small", "probe", "large")]
        out.append(f"\npeak RSS of each warmer step (goal: the same files with more bytes add at most "
                   f"{_mib(RSS_GROWTH_GOAL)})")
        out.append(f"| step | {cols[0]} | {cols[1]} | added by the bytes | {cols[2]} | per added file |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for name, m in mem.items():
            r = m["rss"]
            added = round((r["probe"] - r["small"]) / 2**20)
            out.append(f"| {name} | {_mib(r['small'])} | {_mib(r['probe'])} | {added:+d} MiB "
                       f"{'met' if m['met'] else 'MISSED'} | {_mib(r['large'])} | {m['kib_per_file']:.1f} KiB |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    global DROP_CACHES, WARMER_SRC
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=tree.parse_size, default=tree.parse_size("1GiB"),
                   help="the tree's size (default 1GiB); also run at a quarter of it for peak memory")
    p.add_argument("--sizes", help="comma-separated sizes instead (e.g. 64MiB,16MiB)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--level", type=int, default=3, help="zstd level on both sides (warmer's default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path(".bench"))
    p.add_argument("--json", type=Path, help="write the results here (default WORKDIR/results.json)")
    p.add_argument("--aws", default=None, help="the AWS CLI (default: .venv-aws/bin/aws, else aws on PATH)")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    p.add_argument("--warmer-src", type=Path, help="run the warmer package of this source tree instead (e.g. a "
                                                   "worktree of an older commit, to measure a change)")
    p.add_argument("--discard-roots", action="store_true",
                   help="remove each restored root once measured (tmpfs, or filesystems with a journal); "
                        "by default they are kept until the end: see bench_size")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before every timed command (root only; slows the whole machine)")
    a = p.parse_args(argv)
    if a.trials < 1:
        p.error("--trials must be at least 1")
    DROP_CACHES = a.drop_caches
    if a.warmer_src:
        if not (a.warmer_src / "warmer" / "__init__.py").is_file():
            p.error(f"--warmer-src {a.warmer_src}: no warmer package there")
        WARMER_SRC = str(a.warmer_src.absolute())
    if DROP_CACHES and os.geteuid() != 0:
        p.error("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    sizes = [tree.parse_size(s) for s in a.sizes.split(",")] if a.sizes else [a.size, a.size // 4]

    missing = [t for t in ("zstd", "tar", "sync") if not shutil.which(t)]
    if missing:
        print(f"bench: {', '.join(missing)} not found: install them (Debian/Ubuntu: apt-get install zstd tar)",
              file=sys.stderr)
        return 2
    if "GNU tar" not in (_first_line(["tar", "--version"]) or ""):
        print("bench: tar is not GNU tar (needed for --zstd): apt-get install tar", file=sys.stderr)
        return 2
    aws = None
    if not a.no_s3:
        aws = a.aws or (str(Path(".venv-aws/bin/aws").absolute()) if Path(".venv-aws/bin/aws").exists()
                        else shutil.which("aws"))
        if not aws:
            print("bench: the AWS CLI is not found: `make bench` installs it into .venv-aws, or pass --aws, "
                  "or --no-s3", file=sys.stderr)
            return 2
    a.workdir = a.workdir.absolute()
    a.workdir.mkdir(parents=True, exist_ok=True)
    # Every restored root stays until the end (see bench_size), trees and archives besides.
    restores = 2 * (1 if a.no_s3 else 2) * a.trials
    need = (sum(s * (restores + 2) for s in sizes) + 4 * max(sizes)) * 11 // 10
    free = shutil.disk_usage(a.workdir).free
    if free < need:
        print(f"bench: {tree.human(need)} of free space needed under {a.workdir}, {tree.human(free)} free: "
              "pass a smaller --size, fewer --trials or another --workdir", file=sys.stderr)
        return 2
    roots = a.workdir / "roots"
    if roots.exists():  # an interrupted run's: deleted at the end, not right before creating files
        roots.rename(a.workdir / f"trash-{time.time_ns()}")
    results = {"machine": machine(a.workdir, aws), "trials": a.trials, "level": a.level, "warmer_src": WARMER_SRC,
               "page_cache": "dropped before each command" if DROP_CACHES else "warm (same for both sides)",
               "load_before": os.getloadavg(), "sizes": []}
    print(f"bench: sizes {[tree.human(s) for s in sizes]}, {a.trials} trials, load {os.getloadavg()[0]:.2f}",
          file=sys.stderr)
    try:
        for size in sizes:
            results["sizes"].append(bench_size(size, a, aws))
        if len(sizes) > 1:  # the smallest tree's files with bigger binaries: memory against bytes alone
            small, large = min(sizes), max(sizes)
            results["memory_probe"] = bench_size(small, a, aws, scale=large // small, baseline=False)
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        for p in [roots, *a.workdir.glob("trash-*")]:
            rmtree(p)
    results["load_after"] = os.getloadavg()
    if "memory_probe" in results:
        # Peak RSS against bytes at a constant file count (streaming: flat), and against the file
        # count (artifact.json's entries are held in memory: a few KiB each).
        small = min(results["sizes"], key=lambda r: r["size"])
        large = max(results["sizes"], key=lambda r: r["size"])
        probe = results["memory_probe"]
        results["memory"] = {}
        for name, s in probe["steps"].items():
            rss = {k: r["steps"][name]["warmer"]["rss"] for k, r in (("small", small), ("probe", probe),
                                                                       ("large", large))}
            growth = rss["probe"] / rss["small"]
            results["memory"][name] = {
                "rss": rss, "growth_with_bytes": growth, "met": rss["probe"] - rss["small"] <= RSS_GROWTH_GOAL,
                "kib_per_file": (rss["large"] - rss["small"]) / 1024 / max(large["files"] - small["files"], 1)}
        results["memory_trees"] = {k: {"files": r["files"], "bytes": r["bytes"]}
                                   for k, r in (("small", small), ("probe", probe), ("large", large))}
    main_size = results["sizes"][0]
    results["ratios"] = {k: s["ratio"] for k, s in main_size["steps"].items() if "ratio" in s}
    results["goals"] = {
        **{k: {"goal": f"<= {g}", "value": results["ratios"].get(k),
               "met": results["ratios"][k] <= g if k in results["ratios"] else None} for k, g in GOALS.items()},
        "noop-fetch": {"goal": f"< {NOOP_GOAL_S} s", "value": main_size["steps"]["noop-fetch"]["warmer"]["seconds"],
                       "met": main_size["steps"]["noop-fetch"]["warmer"]["seconds"] < NOOP_GOAL_S},
        "memory": {"goal": f"same files, ~4x the bytes: peak RSS grows by <= {RSS_GROWTH_GOAL >> 20} MiB",
                   "met": all(m["met"] for m in results.get("memory", {}).values()) if results.get("memory") else None}}
    text = table(results)
    load = results["load_before"], results["load_after"]
    print(f"\nwarmer bench on {results['machine']['cpu']}, {results['machine']['cores']} cores; "
          f"load {load[0][0]:.2f} before, {load[1][0]:.2f} after; page cache {results['page_cache']}{text}")
    out = a.json or a.workdir / "results.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nresults: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
