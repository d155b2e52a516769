"""Human-readable reports. Every number shown is one that was measured."""

from __future__ import annotations


def _s(value) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def pairs(doc: dict) -> str:
    return "\n".join(f"{k}: {v}" for k, v in doc.items() if not isinstance(v, (dict, list)))


def fingerprint(fp: dict) -> str:
    gpu, cpu, paths = fp["gpu"], fp["cpu"], fp["paths"]
    if gpu["mixed"]:
        gpus = "MIXED: " + ", ".join(f"{d['index']}: {d['name']} (sm {d['compute_capability']})"
                                     for d in gpu["devices"])
    elif gpu["count"]:
        gpus = f"{gpu['count']} x {gpu['name']} (sm {gpu['compute_capability']}, FlashInfer arch {gpu['arch']})"
    else:
        gpus = "none" + (f" ({'; '.join(gpu['notes'])})" if gpu.get("notes") else "")
    pkgs = ", ".join(f"{k} {v}" for k, v in sorted(fp["packages"].items())) or "none"
    lines = [
        f"machine:   {fp['machine']} {fp['os']}, glibc {fp['glibc']}, python {fp['python']}",
        f"cpu:       {cpu['model']} ({cpu['vendor']}), {cpu['threads']} threads ({cpu['logical']} logical), "
        f"isa {' '.join(cpu['isa'])}",
        f"gpus:      {gpus}",
    ]
    if gpu["count"]:
        lines.append(f"driver:    {gpu['driver']}, cuda driver {gpu['cuda_driver']} (from {gpu['source']})")
    lines += [
        f"packages:  {pkgs}",
        f"toolchain: torch cuda {fp['torch_cuda']}, nvcc {fp['nvcc']}, ninja {fp['ninja']}",
        "paths:     " + ", ".join(f"{k} {v}" for k, v in paths.items() if v is not None),
    ]
    return "\n".join(lines)


TIMING_ROWS = (("process (start to exit)", "process_s"), ("engine init (LLM())", "engine_init_s"),
               ("vLLM init engine", "init_engine_s"), ("compile warm-up (CPU)", "cpu_compile_warmup_s"),
               ("torch.compile", "torch_compile_s"), ("load weights", "load_weights_s"),
               ("workload", "workload_s"))


def timings_table(cold: dict, restored: dict) -> str:
    lines = [f"  {'phase':<26}{'cold':>10}{'restored':>10}{'ratio':>8}"]
    for label, key in TIMING_ROWS:
        c, r = cold.get(key), restored.get(key)
        if c is None and r is None:
            continue
        # Ratios of sub-0.1 s phases are noise.
        ratio = f"{c / r:.1f}x" if c and r and min(c, r) >= 0.1 else "-"
        lines.append(f"  {label:<26}{_s(c):>10}{_s(r):>10}{ratio:>8}")
    return "\n".join(lines)


def verify(v: dict) -> str:
    files = v["files"]
    lines = [f"verdict: {v['verdict']} - {files['recompiled_files']} recompiled file(s) "
             f"({files['new_files']} new, {files['rewritten_files']} rewritten)"]
    if files["by_component"]:
        lines.append("  by component: " + ", ".join(f"{k} {n}" for k, n in files["by_component"].items()))
    if v["log_recompiles"]:
        lines.append("  vLLM log: " + ", ".join(f"{k} x{n}" for k, n in v["log_recompiles"].items()))
    lines.append(timings_table(v["cold"], v["restored"]))
    lines.append(f"  log: {v['log']}")
    return "\n".join(lines)


def build(r: dict) -> str:
    if r.get("status") == "already-published" and "verify" not in r:
        return f"already published: recipe {r['recipe']}, key {r['key'][:16]} in {r['store']} (nothing to build)"
    lines = [f"recipe {r['recipe']}  key {r['key'][:16]}",
             f"artifact: {r['artifact']} ({r['files']} files, {_mb(r['bytes'])} -> {_mb(r['archive_bytes'])})"]
    lines += [f"  {name:<18}{c['files']:>6} files {_mb(c['bytes']):>12}" for name, c in r["components"].items()]
    lines.append(f"restore for verify: {_s(r['restore']['seconds'])}")
    lines.append(verify(r["verify"]))
    if "publish" in r:
        p = r["publish"]
        lines.append(f"publish: {p['status']} to {p['store']} (blob {p['blob'][:16]}, "
                     f"{'uploaded' if p['blob_uploaded'] else 'already there'})")
    return "\n".join(lines)


def fetch(r: dict) -> str:
    lines = [f"warmer fetch: {r['status']} - recipe {r['recipe']}, key {r['key'][:16]}, root {r['root']}"]
    if "for_gpus" in r:
        lines.append(f"  for GPUs: {r['for_gpus']}")
    if "restore" in r:
        rs = r["restore"]
        extra = f", {rs['files']} files, {_mb(rs['bytes'])}" if "files" in rs else ""
        lines.append(f"  restore: {rs['status']} in {_s(rs['seconds'])}{extra}")
    if r.get("nearest"):
        n = r["nearest"]
        if n["differences"]:
            lines.append(f"  nearest artifact {n['key'][:16]} differs in: " + "; ".join(n["differences"]))
        else:  # fits, but was published under another key: an older warmer's rules
            lines.append(f"  artifact {n['key'][:16]} fits this node but was published under another key; "
                         "rebuild it with this warmer version (`warmer explain` shows every rule)")
    return "\n".join(lines)


def explain(r: dict, verbose: bool = False) -> str:
    """Accepted artifacts, then rejected ones nearest first, each failed rule with its reason."""
    lines = [f"recipe {r['recipe']} in {r['store']}: {r['accepted']} accepted, {r['rejected']} rejected "
             f"for this node (key {r['node_key'][:16]})", f"this node: {r['node']}"]
    lines += [f"  warning: {p}" for p in r["problems"] + r["volatile_env"]]
    if not r["candidates"]:
        lines.append("no artifact of this recipe is published in this store")
    for c in r["candidates"]:
        verdict = "ACCEPTED" if c["accepted"] else "rejected"
        failed = ", ".join(f"{len(v)} {k}" for k, v in c["failed"].items() if v)
        lines.append(f"{verdict:<9}{c['key'][:16]}{'  (this node key)' if c['exact'] else ''}"
                     f"{'  fails ' + failed if failed else ''}  published {c['published_at']}")
        lines.append(f"           built on {c['built_on']}")
        for d in c["decisions"]:
            if not d["ok"] or (verbose and d["rule"] != "advisory"):
                lines.append(f"    {'ok ' if d['ok'] else 'NO '} {d['field']} [{d['rule']}]: {d['reason']}")
                if not d["ok"] and d["why"]:
                    lines.append(f"         why: {d['why']}")
        if c["advisory_differences"]:
            lines.append(f"    advisory differences (not decisive): {', '.join(c['advisory_differences'])}")
    lines += [f"unreadable {u['key'][:16]}: {u['error']}" for u in r["unreadable"]]
    return "\n".join(lines)


def flashinfer_check(r: dict) -> str:
    lines = []
    if r["contract"]:
        lines.append("path contract broken (FlashInfer will rebuild):")
        lines += [f"  - {c}" for c in r["contract"]]
    for title, key in (("ninja dry run", "dry_run"), ("ninja dry run after back-dating", "dry_run_after")):
        d = r.get(key)
        if d is None:
            continue
        if d.get("skipped"):
            lines.append(f"{title}: {d['skipped']}")
            continue
        lines.append(f"{title}: {len(d['modules'])} module(s), "
                     + ("no work to do" if d["clean"] else "rebuilds needed"))
        for name, m in d["modules"].items():
            lines.append(f"  {name}: {'no work to do' if m['clean'] else 'REBUILD: ' + '; '.join(m['reasons'][:2])}")
    if r["newer_inputs"]:
        lines.append(f"{len(r['newer_inputs'])} input(s) newer than the cache, e.g. {r['newer_inputs'][0]['file']}: "
                     "rerun with --backdate (add --include-site-packages for installed headers)")
    if "backdate" in r:
        b = r["backdate"]
        lines.append(f"back-dated {len(b['files'])} file(s); left {len(b['held_back_site_packages'])} in site-packages")
    return "\n".join(lines) or "no FlashInfer JIT modules under this root"
