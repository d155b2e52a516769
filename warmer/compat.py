"""Which fingerprint fields must match for a cache to fit, the key, and the decision trace.

- hard: must be equal. They go into the key, so a node finds its artifact with one lookup.
- ranged: the node must satisfy a rule against the build's value (a newer driver runs code
  built for an older one).
- advisory: recorded and shown, never decisive.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from packaging.version import InvalidVersion, Version


def _gpu_devices(fp: dict) -> list[list[str]]:
    return [[d["name"], d["compute_capability"]] for d in fp["gpu"]["devices"]]


def hard_fields(fp: dict) -> dict:
    """The fields that must be equal, flattened to dotted names."""
    fields = {
        "machine": fp["machine"],
        "os": fp["os"],
        "python": fp["python"],
        # Inductor's C++ kernel keys hold -I paths into the Python install.
        "paths.python_prefix": fp["paths"]["python_prefix"],
        "torch_cuda": fp["torch_cuda"],
        "gpu.devices": _gpu_devices(fp),
    }
    for name, version in sorted(fp["packages"].items()):
        fields[f"packages.{name}"] = version
    if not fp["gpu"]["devices"]:
        # CPU backends: Inductor's cache keys on neither ISA nor core count, yet kernels built
        # for AVX-512 give wrong numbers on AVX2, and the thread count is baked into them.
        fields["cpu.isa"] = fp["cpu"]["isa"]
        fields["cpu.threads"] = fp["cpu"]["threads"]
    return fields


RANGED = {
    "gpu.driver": "node >= build",
    "gpu.cuda_driver": "node >= build",
}
ADVISORY = ("glibc", "cpu.model", "nvcc", "paths.cuda_home")


def _get(fp: dict, dotted: str):
    value = fp
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def key(fp: dict, recipe_identity: dict) -> str:
    """sha256 over the hard fields and the recipe identity: what a node looks up."""
    doc = {"hard": hard_fields(fp), "recipe": recipe_identity}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Decision:
    field: str
    rule: str
    built: object
    node: object
    ok: bool
    reason: str


def _newer_or_equal(built, node) -> tuple[bool, str]:
    if built is None:
        return True, "the build recorded none"
    if node is None:
        return False, f"the build had {built}, this node has none"
    try:
        ok = Version(str(node)) >= Version(str(built))
    except InvalidVersion:
        return node == built, "not a version: compared as text"
    return ok, "ok" if ok else f"{node} is older than the build's {built}"


def check(built: dict, node: dict) -> list[Decision]:
    """Every rule, field by field: what the artifact was built on against this node."""
    out = []
    b_hard, n_hard = hard_fields(built), hard_fields(node)
    for field in sorted(set(b_hard) | set(n_hard)):
        b, n = b_hard.get(field), n_hard.get(field)
        ok = b == n
        out.append(Decision(field, "equal", b, n, ok, "ok" if ok else f"built with {b!r}, this node has {n!r}"))
    for field, rule in RANGED.items():
        b, n = _get(built, field), _get(node, field)
        ok, reason = _newer_or_equal(b, n)
        out.append(Decision(field, rule, b, n, ok, reason))
    for field in ADVISORY:
        b, n = _get(built, field), _get(node, field)
        out.append(Decision(field, "advisory", b, n, True, "same" if b == n else "differs (not decisive)"))
    return out


def fits(decisions: list[Decision]) -> bool:
    return all(d.ok for d in decisions)


def as_dicts(decisions: list[Decision]) -> list[dict]:
    return [asdict(d) for d in decisions]
