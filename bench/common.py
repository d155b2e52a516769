"""What every benchmark shares: running a command as a process of its own and measuring it, the
servers it talks to on loopback (moto, s3rver, the throttling proxy), and the machine's description.

Every command runs through LAUNCHER: wall time from start to exit, peak RSS from wait4 (for a
pipeline, its largest process) and the CPU seconds of the command and its children. `sync` runs
(untimed) before every timed command.
"""

from __future__ import annotations

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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPE = HERE / "recipe.toml"
SUBDIRS = ("inductor", "vllm", "triton", "flashinfer")
BUCKET = "warmer-bench"
S3RVER = REPO / ".s3rver" / "node_modules" / ".bin" / "s3rver"  # `make bench` installs it there


class BenchError(Exception):
    pass


DROP_CACHES = False  # --drop-caches
WARMER_SRC: str | None = None  # --warmer-src: another checkout's warmer (a before/after comparison)

# Forks and times the command from a process of a few MiB: a child forked from the runner would
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
    f.write(f"{time.perf_counter() - t0} {usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(cmd: list[str] | str, env: dict | None = None, cwd: Path | None = None,
            cpus: str | None = None) -> dict:
    """Run cmd (a list, or a bash pipeline) to completion: seconds, peak RSS, CPU seconds, stdout.
    cpus: a taskset CPU list (e.g. "0" or "0,1") for the command and everything it starts."""
    argv = ["bash", "-o", "pipefail", "-c", cmd] if isinstance(cmd, str) else cmd
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    subprocess.run(["sync"], check=True)
    if DROP_CACHES:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    with tempfile.NamedTemporaryFile("r") as usage:
        p = subprocess.run([sys.executable, "-I", "-S", "-c", LAUNCHER, usage.name, *argv], env=env, cwd=cwd,
                           capture_output=True, text=True, errors="replace")
        seconds, rss_kib, cpu = usage.read().split()
    if p.returncode != 0:
        shown = cmd if isinstance(cmd, str) else " ".join(cmd)
        raise BenchError(f"`{shown}` exited {p.returncode}:\n{p.stderr[-3000:]}")
    # ru_maxrss is in KiB on Linux; for a pipeline, that of its largest process.
    return {"seconds": float(seconds), "rss": int(rss_kib) * 1024, "cpu_s": float(cpu), "stdout": p.stdout, "stderr": p.stderr}


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
    out = {"seconds": statistics.median(r["seconds"] for r in runs),
           "rss": int(statistics.median(r["rss"] for r in runs)),
           "trials_s": [round(r["seconds"], 3) for r in runs]}
    if all("cpu_s" in r for r in runs):
        out["cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
    return out


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


def load() -> float:
    return round(os.getloadavg()[0], 2)


# -- servers on loopback ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:  # poll until it answers HTTP
        if proc.poll() is not None:
            raise BenchError(f"{what} exited {proc.returncode}: see {log}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(f"{what} did not answer on {url} in 30 s: see {log}")
            time.sleep(0.05)


@contextlib.contextmanager
def server(argv: list[str], url: str, what: str, log: Path, probe: str = "/"):
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_http(url + probe, proc, what, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def moto_server(workdir: Path):
    """moto's S3 server: correct (conditional writes) and slow on ranged GETs of big objects."""
    port = free_port()
    with server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                f"http://127.0.0.1:{port}", "moto server", workdir / "moto.log", "/moto-api/") as url:
        yield url


@contextlib.contextmanager
def s3rver(workdir: Path):
    """s3rver (npm): a Node S3 API server on a directory, that serves ranged GETs at loopback speed
    (no conditional writes: speed rows only). Its bucket is BUCKET."""
    if not S3RVER.exists():
        raise BenchError(f"s3rver is not installed at {S3RVER.relative_to(REPO)}: `make bench` installs it "
                         "(npm install --prefix .s3rver s3rver@3.7.1)")
    data = workdir / "s3rver"
    rmtree(data)
    data.mkdir(parents=True)
    port = free_port()
    with server([str(S3RVER), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--silent",
                 "--configure-bucket", BUCKET], f"http://127.0.0.1:{port}", "s3rver", workdir / "s3rver.log") as url:
        yield url
    rmtree(data)


@contextlib.contextmanager
def throttled(upstream: str, rate: float, workdir: Path):
    """tests/integration/faultproxy.py in a process of its own, in front of upstream: every answer's
    body shares one link of rate bytes per second."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)
    log = workdir / f"proxy-{int(rate)}.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.faultproxy", f"{host}:{port}",
                                 "--rate", str(rate)], cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise BenchError(f"the throttling proxy did not start: see {log}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def aws_env(workdir: Path, endpoint: str) -> dict:
    """Dummy credentials and the loopback endpoint; no AWS config of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(workdir / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(workdir / "no-aws-credentials"))
    return env


def find_aws(explicit: str | None = None) -> str | None:
    local = REPO / ".venv-aws" / "bin" / "aws"
    return explicit or (str(local) if local.exists() else shutil.which("aws"))


# -- the machine --------------------------------------------------------------------------------

def first_line(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return (r.stdout.strip() or r.stderr.strip()).splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def machine(workdir: Path, aws: str | None = None) -> dict:
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

    s3rver_version = None
    with contextlib.suppress(OSError, ValueError):
        s3rver_version = json.loads((REPO / ".s3rver/node_modules/s3rver/package.json").read_text())["version"]
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "disk": {"device": dev, "fs": fstype, "mount": best, "free_bytes": du.free},
            "python": platform.python_version(),
            "versions": {"warmer": version("warmer"), "zstandard": version("zstandard"), "boto3": version("boto3"),
                         "moto": version("moto"), "s3rver": s3rver_version, "zstd": first_line(["zstd", "--version"]),
                         "tar": first_line(["tar", "--version"]), "node": first_line(["node", "--version"]),
                         "aws": first_line([aws, "--version"]) if aws else None}}


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


class Ctx:
    """One tree's benchmark: where things go, how many trials, and the helpers every step uses.
    Restored roots are kept until the end of the run (creating thousands of files right after
    deleting thousands is slow on ext4 without a journal: no trial should pay for the one before)
    and dropped from the page cache once measured."""

    def __init__(self, args, root: Path, label: str, baseline: bool = True):
        self.args, self.root, self.label, self.baseline = args, root, label, baseline
        self.workdir: Path = args.workdir
        self.trials = args.trials if baseline else 1
        self.steps: dict = {}

    def base(self, run):
        return run if self.baseline else None

    def say(self, name: str) -> None:
        s = self.steps[name]
        line = f"  {name}: warmer {s['warmer']['trials_s']}"
        if "baseline" in s:
            line += f", baseline {s['baseline']['trials_s']}, ratio {s['ratio']:.2f}"
        print(line + f" (load {load()})", file=sys.stderr)

    def new_root(self, label: str) -> Path:
        p = self.workdir / "roots" / f"{self.label}-{label}"
        rmtree(p)
        p.parent.mkdir(exist_ok=True)
        return p

    def done(self, root: Path, keep: bool = False) -> None:
        if self.args.discard_roots and not keep:
            rmtree(root)
        else:
            evict(root)

    def fetch(self, store_url: str, root: Path, env=None, expect="hit", keep=False) -> dict:
        r = measure(warmer("fetch", str(RECIPE), "--store", store_url, "--root", str(root), "--json"), env=env)
        got = json.loads(r["stdout"])
        if got["status"] != expect:
            raise BenchError(f"warmer fetch from {store_url}: {got['status']}, expected {expect}: {got['warnings']}")
        self.done(root, keep)
        return r

    def untar(self, cmd: str, root: Path, env=None) -> dict:
        root.mkdir()
        r = measure(cmd.format(root=root), env=env)
        self.done(root)
        return r
