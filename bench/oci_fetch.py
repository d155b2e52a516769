"""warmer fetch from an OCI registry against `curl` of the blob + `tar --zstd -x`, side by side.

On a synthetic cache tree (bench/tree.py), packed by warmer and published to a real registry on
loopback (CNCF distribution: Debian's docker-registry, no auth, filesystem storage under the
workdir), the median of --trials runs of each side, interleaved:

    restore-oci   warmer fetch oci://127.0.0.1:PORT/bench/caches    (manifest, artifact.json,
                  parallel ranged GETs of the layer, sha256 of it and of every file, atomic swap)
    baseline      curl -o FILE http://127.0.0.1:PORT/v2/bench/caches/blobs/sha256:HEX
                  && tar --zstd -xf FILE -C ROOT                    (no check of anything)

plus warmer's publish (once: layer upload in chunks, artifact.json, manifest, settle) for
reference. Every command is a process of its own, timed from start to exit, with its peak RSS
from wait4 (bench/common.py's launcher); each restore goes into a new root, dropped from the page
cache once measured. `oras pull` or `crane` would be the baseline of choice; neither is
installable here (no Debian package, no PyPI wheel), so it is curl.

    python bench/oci_fetch.py [--size 1GiB] [--trials 3] [--workdir .bench] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/common.py: measure, pair, evict, the launcher)
import tree  # noqa: E402

REPO_NAME = "bench/caches"


def start_registry(workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("docker-registry") or shutil.which("registry")
    if not binary:
        raise common.BenchError("no OCI registry: `apt-get install docker-registry` (CNCF distribution) as root")
    port = common.free_port()
    config = workdir / "registry.yml"
    config.write_text("\n".join([
        "version: 0.1", "log:", "  level: info", "  accesslog:", "    disabled: true", "storage:", "  filesystem:",
        f"    rootdirectory: {workdir / 'registry'}", "  delete:", "    enabled: true", "http:",
        f"  addr: 127.0.0.1:{port}", "  secret: warmer-bench"]) + "\n")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    up = threading.Event()

    def watch():  # released by the log line that says it listens (or by its exit)
        for line in proc.stderr:
            if b"listening on" in line:
                up.set()
        up.set()

    threading.Thread(target=watch, daemon=True).start()
    if not up.wait(60) or proc.poll() is not None:
        proc.kill()
        raise common.BenchError(f"the registry ({binary}) did not start")
    return proc, port


def version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1GiB", type=tree.parse_size)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(".bench"), help="its own oci/ folder in it is replaced")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    wd = args.workdir.absolute() / "oci"  # never the folder given: it may hold anything (run.py's results)
    common.rmtree(wd)
    wd.mkdir(parents=True)
    for tool in ("curl", "tar", "zstd"):
        if not shutil.which(tool):
            raise common.BenchError(f"{tool} is needed for the baseline: apt-get install {tool}")

    root = wd / "tree"
    t0 = time.perf_counter()
    info = tree.generate(root, args.size, args.seed)
    print(f"tree: {info['files']} files, {tree.human(info['bytes'])} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    art = wd / "warmer.tar.zst"
    common.measure(common.warmer("pack", str(root), "--recipe", str(common.RECIPE), "-o", str(art), "--level",
                           str(args.level), "--json"))
    proc, port = start_registry(wd)
    try:
        store = f"oci://127.0.0.1:{port}/{REPO_NAME}"
        pub = common.measure(common.warmer("publish", str(art), "--store", store, "--json"))
        published = json.loads(pub["stdout"])
        if published["status"] != "published":
            raise common.BenchError(f"publish: {published['status']}")
        blob_url = f"http://127.0.0.1:{port}/v2/{REPO_NAME}/blobs/sha256:{published['blob']}"
        roots = wd / "roots"
        roots.mkdir()

        def w_fetch(i, last):
            dest = roots / f"warmer-{i}"
            r = common.measure(common.warmer("fetch", str(common.RECIPE), "--store", store, "--root", str(dest), "--json"))
            got = json.loads(r["stdout"])["status"]
            if got != "hit":
                raise common.BenchError(f"warmer fetch from {store}: {got}")
            common.evict(dest)
            return r

        def b_fetch(i, last):
            dest = roots / f"baseline-{i}"
            dest.mkdir()
            blob = wd / "pulled.tar.zst"
            r = common.measure(f"curl -sf -o {blob} {blob_url} && tar --zstd -xf {blob} -C {dest}")
            common.rmtree(blob)
            common.evict(dest)
            return r

        result = common.pair(args.trials, w_fetch, b_fetch)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    cache = info["bytes"]
    out = {"tree_files": info["files"], "tree_bytes": cache, "archive_bytes": art.stat().st_size,
           "publish": {"seconds": pub["seconds"], "rss": pub["rss"]}, "restore-oci": result,
           "software": {"registry": version(["docker-registry", "--version"]), "curl": version(["curl", "--version"]),
                        "tar": version(["tar", "--version"]), "zstd": version(["zstd", "--version"])}}
    w, b = result["warmer"], result["baseline"]
    mb = cache / 1e6
    print(f"\n{info['files']} files, {cache / 2**20:.0f} MiB of cache, archive {art.stat().st_size / 2**20:.0f} MiB\n")
    print("| step | warmer s | MB/s | peak RSS | baseline | baseline s | MB/s | peak RSS | warmer/baseline |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    print(f"| restore-oci | {w['seconds']:.2f} | {mb / w['seconds']:.0f} | {w['rss'] / 2**20:.0f} MiB | curl blob + "
          f"tar --zstd -x | {b['seconds']:.2f} | {mb / b['seconds']:.0f} | {b['rss'] / 2**20:.0f} MiB | "
          f"{result['ratio']:.2f} |")
    print(f"| publish-oci | {pub['seconds']:.2f} | {mb / pub['seconds']:.0f} | {pub['rss'] / 2**20:.0f} MiB | - | | | | |")
    print(f"\ntrials: warmer {w['trials_s']}, baseline {b['trials_s']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    common.rmtree(wd / "roots")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.BenchError as e:
        print(f"oci_fetch: {e}", file=sys.stderr)
        sys.exit(1)
