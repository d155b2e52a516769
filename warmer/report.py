"""Human-readable reports of warmer's results. Every number shown is one that was measured."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a node's fetch does not import (see warmer.api)
    from warmer.api import Inspection
    from warmer.build import BuildResult, PublishResult
    from warmer.catalog import Collection, Listing, Removal
    from warmer.doctor import Diagnosis
    from warmer.explain import Explanation
    from warmer.fetch import FetchResult
    from warmer.fingerprint import Fingerprint
    from warmer.verify import VerifyResult


def seconds(value) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def megabytes(n) -> str:
    return f"{n / 1e6:.1f} MB" if isinstance(n, (int, float)) else "-"


def pairs(doc: dict) -> str:
    return "\n".join(f"{k}: {v}" for k, v in doc.items() if not isinstance(v, (dict, list)))


def fingerprint(fp: Fingerprint) -> str:
    gpu, cpu, paths = fp.gpu, fp.cpu, fp.paths
    if gpu.mixed:
        gpus = "MIXED: " + ", ".join(f"{d.index}: {d.name} (sm {d.compute_capability})" for d in gpu.devices)
    elif gpu.count:
        gpus = f"{gpu.count} x {gpu.name} (sm {gpu.compute_capability}, FlashInfer arch {gpu.arch})"
    else:
        gpus = "none" + (f" ({'; '.join(gpu.notes)})" if gpu.notes else "")
    pkgs = ", ".join(f"{k} {v}" for k, v in sorted(fp.packages.items())) or "none"
    lines = [
        f"machine:   {fp.machine} {fp.os}, glibc {fp.glibc}, python {fp.python}",
        f"cpu:       {cpu.model} ({cpu.vendor}), {cpu.threads} threads ({cpu.logical} logical), isa {' '.join(cpu.isa)}",
        f"gpus:      {gpus}",
    ]
    if gpu.count:
        lines.append(f"driver:    {gpu.driver}, cuda driver {gpu.cuda_driver} (from {gpu.source})")
    lines += [
        f"packages:  {pkgs}",
        f"toolchain: torch cuda {fp.torch_cuda}, nvcc {fp.nvcc}, ninja {fp.ninja}",
        "paths:     " + ", ".join(f"{k} {v}" for k, v in vars(paths).items() if v is not None),
    ]
    return "\n".join(lines)


TIMING_ROWS = (
    ("process (start to exit)", "process_s"),
    ("engine init (LLM())", "engine_init_s"),
    ("vLLM init engine", "init_engine_s"),
    ("compile warm-up (CPU)", "cpu_compile_warmup_s"),
    ("torch.compile", "torch_compile_s"),
    ("load weights", "load_weights_s"),
    ("workload", "workload_s"),
)


def timings_table(cold: dict, restored: dict) -> str:
    lines = [f"  {'phase':<26}{'cold':>10}{'restored':>10}{'ratio':>8}"]
    for label, key in TIMING_ROWS:
        c, r = cold.get(key), restored.get(key)
        if c is None and r is None:
            continue
        # Ratios of sub-0.1 s phases are noise.
        ratio = f"{c / r:.1f}x" if c and r and min(c, r) >= 0.1 else "-"
        lines.append(f"  {label:<26}{seconds(c):>10}{seconds(r):>10}{ratio:>8}")
    return "\n".join(lines)


def phases_table(cold: dict, restored: dict) -> str:
    """Where a start's time goes (warmup.phases), cold against restored, and what a cache could
    still take away from each phase of the restored start."""
    from warmer.warmup import PHASE_NOTES, PHASE_ORDER

    c, r = cold.get("phases") or {}, restored.get("phases") or {}
    if not r:
        return ""
    lines = [f"  {'phase of the start':<24}{'cold':>9}{'restored':>10}  a cache could still remove it?"]
    for name in [n for n in PHASE_ORDER if n in c or n in r] + sorted((set(c) | set(r)) - set(PHASE_ORDER)):
        lines.append(f"  {name:<24}{seconds(c.get(name)):>9}{seconds(r.get(name)):>10}  {PHASE_NOTES.get(name, '')}")
    return "\n".join(lines)


def verify(v: VerifyResult) -> str:
    f = v.files
    lines = [f"verdict: {v.verdict} - {f.recompiled} recompiled file(s) ({f.new} new, {f.rewritten} rewritten)"]
    if f.by_component:
        lines.append("  by component: " + ", ".join(f"{k} {n}" for k, n in f.by_component.items()))
    if v.outside_root:
        lines.append(f"  {len(v.outside_root)} file(s) written outside the root, e.g. {v.outside_root[0]['path']}")
    if v.log_recompiles:
        lines.append("  vLLM log: " + ", ".join(f"{k} x{n}" for k, n in v.log_recompiles.items()))
    lines.append(timings_table(v.cold, v.restored))
    table = phases_table(v.cold, v.restored)
    if table:
        lines.append(table)
    lines.append(f"  log: {v.log}")
    return "\n".join(lines)


def uncovered(files: tuple[dict, ...]) -> list[str]:
    return [
        f"uncovered cache: {u['path']} ({u['bytes']} bytes) was written outside every component: it is not "
        "packed; a node will write it again"
        for u in files
    ]


def publish(p: PublishResult) -> str:
    return (
        f"publish: {p.status} to {p.store} (blob {p.blob[:16]}, {'uploaded' if p.blob_uploaded else 'already there'})"
    )


def build(r: BuildResult) -> str:
    if r.status == "already-published" and r.verify is None:
        return f"already published: recipe {r.recipe}, key {r.key[:16]} in {r.store} (nothing to build)"
    lines = [
        f"recipe {r.recipe}  key {r.key[:16]}",
        f"artifact: {r.artifact} ({r.files} files, {megabytes(r.bytes)} -> {megabytes(r.archive_bytes)})",
    ]
    lines += [f"  {name:<18}{c.files:>6} files {megabytes(c.bytes):>12}" for name, c in (r.components or {}).items()]
    if r.env_added:
        lines.append("env added at build: " + ", ".join(f"{k}={v}" for k, v in r.env_added.items()))
    if r.restore:
        lines.append(f"restore for verify: {seconds(r.restore.seconds)}")
    if r.verify:
        lines.append(verify(r.verify))
    if r.publish:
        lines.append(publish(r.publish))
    return "\n".join(lines)


def fetch(r: FetchResult) -> str:
    lines = [f"warmer fetch: {r.status} - recipe {r.recipe}, key {r.key[:16]}, root {r.root}"]
    if r.for_gpus:
        lines.append(f"  for GPUs: {r.for_gpus}")
    if r.restore:
        rs = r.restore
        extra = f", {rs.files} files, {megabytes(rs.bytes)}" if rs.files is not None else ""
        lines.append(f"  restore: {rs.status} in {seconds(rs.seconds)}{extra}")
    if r.nearest:
        n = r.nearest
        if n.differences:
            lines.append(f"  nearest artifact {n.key[:16]} differs in: " + "; ".join(n.differences))
        else:  # fits, but was published under another key: an older warmer's rules
            lines.append(
                f"  artifact {n.key[:16]} fits this node but was published under another key; "
                "rebuild it with this warmer version (`warmer explain` shows every rule)"
            )
    if any(d.recompiles for d in r.vllm_differences):
        lines.append(
            f"  predicted: vLLM recompiles ({', '.join(d.name for d in r.vllm_differences if d.recompiles)}"
            " differ from the build)"
        )
    return "\n".join(lines)


def explain(r: Explanation, verbose: bool = False) -> str:
    """Accepted artifacts, then rejected ones nearest first, each failed rule with its reason."""
    lines = [
        f"recipe {r.recipe} in {r.store}: {r.accepted} accepted, {r.rejected} rejected "
        f"for this node (key {r.node_key[:16]})",
        f"this node: {r.node}",
    ]
    lines += [f"  warning: {p}" for p in r.unfit + r.volatile_env]
    if not r.candidates:
        lines.append("no artifact of this recipe is published in this store")
    for c in r.candidates:
        verdict = "ACCEPTED" if c.accepted else "rejected"
        failed = ", ".join(f"{len(v)} {k}" for k, v in (("hard", c.failed_hard), ("ranged", c.failed_ranged)) if v)
        lines.append(
            f"{verdict:<9}{c.key[:16]}{'  (this node key)' if c.exact else ''}"
            f"{'  fails ' + failed if failed else ''}  published {c.published_at.isoformat()}"
        )
        lines.append(f"           built on {c.built_on}")
        for d in c.decisions:
            if not d.ok or (verbose and d.kind != "advisory"):
                lines.append(f"    {'ok ' if d.ok else 'NO '} {d.field} [{d.kind}]: {d.reason}")
                if not d.ok and d.why:
                    lines.append(f"         why: {d.why}")
        if c.advisory_differences:
            lines.append(f"    advisory differences (not decisive): {', '.join(c.advisory_differences)}")
    lines += [f"unreadable {key[:16]}: {why}" for key, why in r.unreadable]
    return "\n".join(lines)


def _orphans(blobs) -> str:
    return f"{len(blobs)} orphan blob(s), {sum(b.size for b in blobs) / 1e6:.1f} MB"


def ls(r: Listing) -> str:
    # No entry names an orphan blob: an upload in flight or a lost publish race, gc's to delete.
    orphans = (
        f"{_orphans(r.orphans)} that no index entry names (an upload in flight, or left by an "
        f"interrupted publish): `warmer gc --dry-run` lists them, gc deletes them once "
        f"{_grace_hours():.0f} h old"
        if r.orphans
        else None
    )
    if not r.rows and not r.unreadable:
        return "\n".join([f"{r.store}: no artifacts"] + ([orphans] if orphans else []))
    lines = [f"{'RECIPE':<28} {'KEY':<16} {'MACHINE':<28} {'PUBLISHED':<25} {'SIZE':>10} {'VERIFY':<8}"]
    for row in r.rows:
        lines.append(
            f"{row.recipe:<28} {row.key[:16]:<16} {row.machine:<28} "
            f"{row.published_at.isoformat():<25} {row.archive_bytes / 1e6:>7.1f} MB {row.verify or '-':<8}"
        )
    for u in r.unreadable:
        lines.append(f"{u.recipe:<28} {u.key[:16]:<16} UNREADABLE: {u.why}")
    lines.append(f"{len(r.rows)} artifact(s) in {r.store}; details: warmer inspect {r.store}/index/RECIPE/KEY")
    if r.unreadable:
        lines.append(
            f"{len(r.unreadable)} unreadable entr{'y' if len(r.unreadable) == 1 else 'ies'}: remove with "
            f"`warmer rm {r.store}/index/RECIPE/KEY --yes`"
        )
    if orphans:
        lines.append(orphans)
    return "\n".join(lines)


def _grace_hours() -> float:
    from warmer.catalog import ORPHAN_GRACE

    return ORPHAN_GRACE.total_seconds() / 3600


def _orphan(b) -> str:
    return f"orphan blob {b.sha256[:16]} ({megabytes(b.size)}, uploaded {b.modified.isoformat(timespec='seconds')})"


def gc(r: Collection) -> str:
    verb = "would delete" if r.dry_run else "deleted"
    lines = [
        f"{verb}: {e.recipe} {e.key[:16]} ({e.machine}, published {e.published_at.isoformat()})"
        for e in r.deleted_entries
    ]
    lines += [f"{verb}: {_orphan(b)}: no index entry names it" for b in r.orphans_deleted]
    lines += [
        f"kept: {_orphan(b)}: no index entry names it, but it is younger than {_grace_hours():.0f} h "
        "(maybe a publish in flight)"
        for b in r.orphans_kept
    ]
    lines.append(
        f"{r.store}: {verb} {len(r.deleted_entries)} of {r.entries} index entries and "
        f"{len(r.deleted_blobs)} blob(s), {r.freed_bytes / 1e6:.1f} MB; kept {r.kept_entries} "
        f"(newest {r.keep} per recipe and machine kind)"
    )
    return "\n".join(lines)


def rm(r: Removal) -> str:
    kept = "kept (another entry names it, or an entry is unreadable)"
    if r.dry_run:  # nothing happened: say what --yes would do, in the conditional
        blob = (
            f"blob {r.blob[:16]} would be {'deleted too' if r.blob_deleted else kept}"
            if r.blob
            else "its blob is unknown (unreadable entry): it would be kept"
        )
        return f"would remove {r.store}/index/{r.recipe}/{r.key}; {blob}; nothing removed: pass --yes to remove it"
    blob = (
        f"blob {r.blob[:16]} {'deleted' if r.blob_deleted else kept}"
        if r.blob
        else "its blob is unknown (unreadable entry): kept"
    )
    return f"removed {r.store}/index/{r.recipe}/{r.key}; {blob}; an audit record is kept in the store"


def inspect(i: Inspection) -> str:
    """An artifact for a person: what it is, what it holds, where it was built; --json has the rest."""
    a = i.artifact
    model = a.recipe.identity.get("model") if isinstance(a.recipe.identity, dict) else None
    lines = [
        f"key:        {a.key}",
        f"recipe:     {a.recipe.name} (digest {a.recipe.digest[:16]}{', model ' + str(model) if model else ''})",
        f"created:    {a.created_at or '-'} by warmer {a.warmer}",
        f"built on:   {a.fingerprint.describe()}",
        f"built at:   root {a.path_contract.root}, model {a.path_contract.model}",
        "components:",
    ]
    lines += [f"  {name:<22}{c.files:>7} files {megabytes(c.bytes):>12}" for name, c in a.components.items()]
    lines.append(f"  {'total':<22}{len(a.files):>7} files {megabytes(a.total_bytes):>12}")
    v = a.timings.get("verify") or {}
    if v:
        lines.append(f"verified:   {v.get('verdict', '-')}, {_shown(v.get('recompiled_files'))} recompiled file(s)")
    if a.vllm:
        lines.append(f"vLLM:       {a.vllm.version or '-'}, config hash {_shown(a.vllm.config_hash)}")
    if a.serve_env:
        lines.append("serve env:  " + ", ".join(f"{k}={v}" for k, v in a.serve_env.items()))
    signature = i.entry.signature if i.entry else i.signature
    lines.append(
        f"signed:     yes, by key {signature.key_id}"
        if signature
        else "signed:     no" + ("" if i.entry else " (no .sig file beside it)")
    )
    if i.entry:
        lines.append(
            f"blob:       {i.entry.blob.sha256} ({megabytes(i.entry.blob.size)}), published "
            f"{i.entry.published_at.isoformat()}"
        )
    lines.append("more: --json (timings, path contract, vLLM's key), --json --full (artifact.json whole)")
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
        lines.append(
            f"{title}: {len(d['modules'])} module(s), " + ("no work to do" if d["clean"] else "rebuilds needed")
        )
        for name, m in d["modules"].items():
            lines.append(f"  {name}: {'no work to do' if m['clean'] else 'REBUILD: ' + '; '.join(m['reasons'][:2])}")
    if r["newer_inputs"]:
        lines.append(
            f"{len(r['newer_inputs'])} input(s) newer than the cache, e.g. {r['newer_inputs'][0]['file']}: "
            "rerun with --backdate (add --include-site-packages for installed headers)"
        )
    if "backdate" in r:
        b = r["backdate"]
        lines.append(
            f"back-dated {len(b['files'])} file(s) in the root; left {len(b['held_back_site_packages'])} in "
            f"site-packages and {len(b['held_back_outside_root'])} elsewhere outside the root"
        )
    return "\n".join(lines) or "no FlashInfer JIT modules under this root"


def _shown(value) -> str:
    return "-" if value is None or value == "" else str(value)


# doctor's messages quote values with repr(): an unset variable reads "VAR is None" there.
_IS_NONE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*) is None\b")


def _unset(text: str) -> str:
    return _IS_NONE.sub(r"\1 is unset", text)


def doctor(r: Diagnosis) -> str:
    from warmer.doctor import ERROR, INFO, WARNING

    rows = [
        (
            row["var"],
            _shown(row["path"]) + (" (default)" if row["default"] else ""),
            f"{_shown(row['kind'])}: "
            + (f"{_shown(row['fstype'])} on {row['mount_point']}" if row["mount_point"] else "?")
            + (", read-only" if row["read_only"] else ""),
        )
        for row in r.locations
    ]
    # Columns as wide as their longest cell, two spaces apart: a long name never runs into its value.
    var_w = max([len("VARIABLE")] + [len(v) for v, _, _ in rows])
    path_w = max([len("PATH")] + [len(p) for _, p, _ in rows])
    lines = ["cache locations:", f"  {'VARIABLE':<{var_w}}  {'PATH':<{path_w}}  FILESYSTEM"]
    lines += [f"  {var:<{var_w}}  {path:<{path_w}}  {where}" for var, path, where in rows]
    if r.root:
        lines.append(f"root: {r.root}")
    for f in r.findings:
        lines.append(f"{f.severity.upper():<8}{f.check}: {_unset(_shown(f.what))}")
        if f.fix != "none":
            lines.append(f"{'':<8}fix: {_unset(_shown(f.fix))}")
    c = r.counts
    lines.append(f"{c[ERROR]} error(s), {c[WARNING]} warning(s), {c[INFO]} note(s)")
    return "\n".join(lines)


# (label, key in the timings) rows of the CI summary: the phases a cold start pays for.
SUMMARY_ROWS = (
    ("engine start (LLM() to ready)", "engine_init_s"),
    ("vLLM init engine", "init_engine_s"),
    ("torch.compile", "torch_compile_s"),
    ("process, start to exit", "process_s"),
)


def step_summary(r: BuildResult | None, *, recipe: str, error: str | None = None) -> str:
    """Markdown for $GITHUB_STEP_SUMMARY: cold and restored times, artifact size, verify result."""
    status = "failed" if error else (r.status if r else "-")
    lines = [f"### warmer build: `{recipe}` — {status}", ""]
    if error:
        lines += [f"> {error}", ""]
    if r is None:
        return "\n".join(lines) + "\n"
    if r.status == "already-published" and r.verify is None:
        lines.append(f"Already published in `{r.store}` (key `{r.key[:16]}`): nothing built.")
        return "\n".join(lines) + "\n"
    v = r.verify
    lines += [
        "| | |",
        "|---|---|",
        f"| key | `{r.key[:16]}` |",
        f"| artifact | {r.files if r.files is not None else '-'} files, {megabytes(r.bytes)} packed to "
        f"{megabytes(r.archive_bytes)} |",
        f"| verify | **{v.verdict if v else '-'}**, {v.files.recompiled if v else '-'} recompiled file(s) |",
    ]
    if r.uncovered:
        lines.append(f"| uncovered caches | {len(r.uncovered)} file(s) outside every component |")
    if r.restore:
        lines.append(f"| restore | {seconds(r.restore.seconds)} |")
    if r.publish:
        lines.append(f"| publish | {r.publish.status} to `{r.publish.store}` |")
    cold, restored = r.cold or {}, (v.restored if v else {})
    rows = [
        (label, cold.get(k), restored.get(k))
        for label, k in SUMMARY_ROWS
        if cold.get(k) is not None or restored.get(k) is not None
    ]
    if rows:
        lines += ["", "| phase | cold | restored |", "|---|---:|---:|"]
        lines += [f"| {label} | {seconds(c)} | {seconds(w)} |" for label, c, w in rows]
    return "\n".join(lines) + "\n"


def local_roots(base, roots) -> str:
    """The roots on this node (warmer ls --root-base)."""
    if not roots:
        return f"{base}: no roots"
    width = max(len("ROOT"), *(len(r.root) for r in roots))
    lines = [f"{'RECIPE':<28} {'ROOT':<{width}} {'KEY':<16} {'SIZE':>10} {'RESTORED':<25} FITS"]
    for r in roots:
        fits = "-" if r.fits is None else "yes" if r.fits else "NO: " + "; ".join(r.why_not)
        lines.append(
            f"{r.recipe:<28} {r.root:<{width}} {(r.key or 'none active')[:16]:<16} {r.bytes / 1e6:>7.1f} MB "
            f"{r.restored_at or '-':<25} {fits}"
        )
    return "\n".join(lines)
