"""Human-readable reports. Every number shown is one that was measured."""

from __future__ import annotations


def _s(value) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def pairs(doc: dict) -> str:
    return "\n".join(f"{k}: {v}" for k, v in doc.items() if not isinstance(v, (dict, list)))


def fingerprint(fp: dict) -> str:
    gpu = fp["gpu"]
    gpus = ", ".join(f"{d['name']} (sm {d['compute_capability']})" for d in gpu["devices"]) or "none"
    pkgs = ", ".join(f"{k} {v}" for k, v in sorted(fp["packages"].items())) or "none"
    return "\n".join([
        f"machine:   {fp['machine']} {fp['os']}, {fp['glibc']}, python {fp['python']}",
        f"cpu:       {fp['cpu']['model']}, {fp['cpu']['threads']} threads, isa {' '.join(fp['cpu']['isa'])}",
        f"gpus:      {gpu['count']}: {gpus}; driver {gpu['driver']}, cuda driver {gpu['cuda_driver']}",
        f"packages:  {pkgs}",
        f"torch cuda {fp['torch_cuda']}, nvcc {fp['nvcc']}",
        f"paths:     python prefix {fp['paths']['python_prefix']}, CUDA_HOME {fp['paths']['cuda_home']}",
    ])


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
    if "restore" in r:
        rs = r["restore"]
        extra = f", {rs['files']} files, {_mb(rs['bytes'])}" if "files" in rs else ""
        lines.append(f"  restore: {rs['status']} in {_s(rs['seconds'])}{extra}")
    if r.get("nearest"):
        n = r["nearest"]
        lines.append(f"  nearest artifact {n['key'][:16]} differs in: " + "; ".join(n["differences"]))
    return "\n".join(lines)
