"""The evidence that a restored cache was hit: start the engine again, see what it had to write.

A full hit means: no cache file appeared or changed under the root (file delta), nothing was
written outside it (the HOME sandbox: a cache no component covers), and vLLM's log shows no
recompile, no FlashInfer JIT build and no cubin download. Timings against the cold build are
reported beside it. On a root that a partial hit assembled (some components restored), the hit is
of those: none of their files appeared or changed, nothing went outside the root, and ninja finds
FlashInfer's restored modules clean; the other components compile, as the fetch said they would
(the log's recompiles are vLLM's whole start, and are not held against it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from warmer import components, progress, restore, serving, warmup
from warmer.components import flashinfer
from warmer.recipe import Recipe


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under root, by root-relative path (warmup.walk: into a shared
    FlashInfer workspace, no link followed there)."""
    return {rel: (st.st_size, st.st_mtime_ns) for rel, st in warmup.walk(root)}


@dataclass(frozen=True)
class FileDelta:
    """Cache files a run created or rewrote, by component; lock files and scratch are ignored."""

    new: int
    rewritten: int
    by_component: dict[str, int] = field(hash=False)
    examples: tuple[str, ...] = ()

    @property
    def recompiled(self) -> int:
        return self.new + self.rewritten

    def to_json(self) -> dict:
        return {
            "new_files": self.new,
            "rewritten_files": self.rewritten,
            "recompiled_files": self.recompiled,
            "by_component": dict(self.by_component),
            "examples": list(self.examples),
        }


def delta(before: dict, after: dict) -> FileDelta:
    new = sorted(p for p in after if p not in before and components.of_path(p))
    rewritten = sorted(p for p in after if p in before and after[p] != before[p] and components.of_path(p))
    by_component: dict[str, int] = {}
    for path in new + rewritten:
        component = components.of_path(path)
        assert component is not None  # new and rewritten hold only paths a component owns
        by_component[component.name] = by_component.get(component.name, 0) + 1
    return FileDelta(len(new), len(rewritten), by_component, tuple((new + rewritten)[:10]))


def _ratio(cold: dict, warm: dict, name: str) -> float | None:
    if cold.get(name) and warm.get(name):
        return round(cold[name] / warm[name], 2)
    return None


@dataclass(frozen=True)
class VerifyResult:
    verdict: str  # hit, partial
    files: FileDelta
    outside_root: tuple[dict, ...]  # files the run wrote outside the root ({path, bytes})
    log_recompiles: dict = field(hash=False)
    flashinfer_dry_run: dict = field(hash=False)
    log_events: dict = field(hash=False)
    restored: dict = field(hash=False)
    cold: dict = field(hash=False)
    log: str = ""
    components: tuple[str, ...] | None = None  # a partial root's restored components (judged alone)
    jit_monitor: dict = field(default_factory=dict, hash=False)  # warmup.jit_monitor of the run

    @property
    def stale_modules(self) -> list[str]:
        """FlashInfer modules ninja's dry run finds out of date, each with its first reason."""
        modules = self.flashinfer_dry_run.get("modules") or {}
        return [
            f"{name} ({(m.get('reasons') or ['out of date'])[0]})"
            for name, m in modules.items()
            if m.get("clean") is False
        ]

    @property
    def certificate(self) -> str:
        """Whether the workload compiled anything after warm-up, as vLLM's JIT monitor saw it. A
        Triton event is a kernel's first use in the process, compiled or loaded: the file delta
        says which."""
        m = self.jit_monitor
        if not m.get("active"):
            return (
                "JIT monitor: not on in this start (vLLM 0.32 switches it on in its GPU worker after "
                "warm-up; not on CPU, nor with enforce_eager): no certificate"
            )
        if not m.get("events"):
            return "JIT monitor: the workload compiled nothing after warm-up (no Triton, CuTe DSL or TileLang event)"
        return (
            f"JIT monitor: {m['events']} compile event(s) after warm-up ({'; '.join(m.get('examples', []))}): "
            "shapes the warm-up did not cover, or kernels loaded late; the recipe's workload should cover "
            "what is served"
        )

    @property
    def speedup(self) -> dict:
        return {n: _ratio(self.cold, self.restored, n) for n in ("init_engine_s", "engine_init_s", "process_s")}

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "files": self.files.to_json(),
            "outside_root": list(self.outside_root),
            "log_recompiles": self.log_recompiles,
            "flashinfer_dry_run": self.flashinfer_dry_run,
            "log_events": self.log_events,
            "restored": self.restored,
            "cold": self.cold,
            "speedup": self.speedup,
            "log": self.log,
            "components": list(self.components) if self.components is not None else None,
            "jit_monitor": {**self.jit_monitor, "certificate": self.certificate},
        }


def verify(
    recipe: Recipe,
    root: Path,
    workdir: Path,
    cold: dict | None = None,
    label: str = "verify",
    extra_env: dict | None = None,
    said_as: str = "verify",
) -> VerifyResult:
    """Run the engine on root once more and judge the hit; cold: the build's timings, if known.
    said_as: what the progress lines call this (build says "build: verify"). The engine gets the env
    the active artifact is served with (its serve_env: AOT off where the build turned it off; what
    each component needs for what it holds), as fetch and serve give it, and extra_env on top."""
    warmup.require_model(recipe)
    marker = restore.active(root)
    held = marker.components if marker else None
    if marker:
        extra_env = {**serving.artifact_env(recipe, root, marker.artifact, components=held).vars, **(extra_env or {})}
    before = snapshot(root)  # ninja's dry run (-n) below writes nothing
    env = serving.environ_for_vllm(recipe, root)
    restored = marker.artifact.path_contract.flashinfer if marker and (held is None or "flashinfer" in held) else None
    # Before the engine starts: afterwards ninja would have rebuilt what it found dirty.
    with progress.step(f"{said_as}: FlashInfer ninja dry run"):
        ninja = flashinfer.dry_run(root, env, restored)
    with progress.step(f"{said_as}: engine run on {root}", log_file=warmup.engine_log(workdir, label)) as s:
        run = warmup.run_engine(recipe, root, workdir, label, extra_env=extra_env)
        after = snapshot(root)
        files = delta(before, after)
        s.done(f"{files.recompiled} recompiled file(s)")
    outside = tuple(u for u in run.uncovered if u["where"] == "home")
    events = run.log["events"]
    recompiles = {e: events[e] for e in warmup.RECOMPILE_EVENTS if events.get(e)}
    if held is None:
        hit = files.recompiled == 0 and not outside and not recompiles and ninja["clean"] is not False
    else:  # a partial root: its restored layers must compile nothing; the rest compiles, as said
        hit = not set(files.by_component) & set(held) and not outside and ninja["clean"] is not False
    return VerifyResult(
        "hit" if hit else "partial",
        files,
        outside,
        recompiles,
        ninja,
        events,
        warmup.timings(run),
        cold or {},
        str(run.log_path),
        held,
        run.log["jit_monitor"],
    )
