"""`warmer doctor`: is this serving environment set up so that vLLM's caches survive and hit?

The checks, each finding with its fix:
- cache locations: the filesystem each cache env var (or its default) lands on, read from
  mountinfo. The container's own overlay root is wiped with every pod (the
  default ~/.cache/vllm); an emptyDir survives container restarts, not a new pod; tmpfs is RAM;
  a hostPath or a persistent volume keeps the cache.
- FlashInfer: the directories it writes at import and at run time must be writable
  (flashinfer/jit/env.py creates the workspace and its log at import: a read-only one fails it).
- per-pod env: values vLLM hashes into its compile key that differ per pod (pod IPs,
  hostnames), so no pod ever hits another's cache (ai-dynamo/dynamo#10695).
- the active artifact (with a root): is it in use (the cache env points into it), does it fit
  this node, and does its path contract hold.

diagnose() takes every input as an argument (env, mountinfo text, node fingerprint) so that
recorded samples stand in for a real pod in tests; check() gathers them on this machine.
Node path: imports neither torch nor vllm.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from warmer import compat, components, fingerprint, restore, workspace
from warmer.contract import user_name
from warmer.envfile import EnvFile
from warmer.errors import UsageError
from warmer.fingerprint import Fingerprint
from warmer.mounts import classify, mount_of, parse_mountinfo, under
from warmer.outlook import ERROR, INFO, WARNING, Finding, outlook
from warmer.recipe import Recipe

FIX_VOLUME = (
    "point {var} into a volume (a hostPath shared by the node's pods, or a persistent volume): "
    "`warmer fetch --env-file` in an init container fills one root there and writes the env "
    "that puts every cache under it (manifests/k8s/)"
)
# Caches whose loss costs the compile time itself; the others cost seconds.
PRIMARY = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE")
# vLLM hashes every known env var into its compile key except an ignore list (vllm envs.py
# compile_factors). These hashed ones hold host or rank values.
HASHED_PER_HOST = {
    "VLLM_RAY_BUNDLE_INDICES": "it splits the cache per Ray placement bundle (one key per engine)",
    "VLLM_RAY_DP_PLACEMENT_NODE_IPS": "it lists node IPs",
    "VLLM_P2P_SIDE_CHANNEL_HOST": "it is a host address",
    "VLLM_P2P_SIDE_CHANNEL_PORT": "it is a port",
    "VLLM_EC_SIDE_CHANNEL_HOST": "it is a host address",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "it is a hostname",
    "VLLM_GPU_NIC_PCIE_MAPPING": "it describes one machine's PCIe topology",
    "VLLM_LOOPBACK_IP": "it is an address",
    "VLLM_DP_RANK": "each data-parallel rank gets its own key",
    "VLLM_DP_RANK_LOCAL": "each data-parallel rank gets its own key",
}
# Hashed by older vLLM releases only.
HASHED_BEFORE = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "vLLM releases before the fix for ai-dynamo/dynamo#10695 hash it (0.32 ignores it)",
}
# The variables Kubernetes sets in every pod for each Service of its namespace (a Service named
# vllm-llama-3-1-8b gives VLLM_LLAMA_3_1_8B_SERVICE_HOST=10.96.14.7, ..._PORT=tcp://...): vLLM hashes
# only the variables it knows (envs.py compile_factors), and it knows none of these.
SERVICE_LINK = re.compile(
    r"[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)?)"
)
# vLLM's ignore list, the entries that look per-host: never a finding.
IGNORED_BY_VLLM = {
    "VLLM_HOST_IP",
    "VLLM_PORT",
    "VLLM_DP_MASTER_IP",
    "VLLM_DP_MASTER_PORT",
    "VLLM_CACHE_ROOT",
    "VLLM_RPC_BASE_PATH",
    "VLLM_CONFIG_ROOT",
    "VLLM_ASSETS_CACHE",
    "VLLM_XLA_CACHE_PATH",
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
}


@dataclass(frozen=True)
class Diagnosis:
    root: str | None
    locations: tuple[dict, ...]
    findings: tuple[Finding, ...]

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(f.severity == s for f in self.findings) for s in (ERROR, WARNING, INFO)}

    @property
    def ok(self) -> bool:
        return self.counts[ERROR] == 0

    def to_json(self) -> dict:
        return {
            "root": self.root,
            "locations": list(self.locations),
            "findings": [f.to_json() for f in self.findings],
            "counts": self.counts,
            "ok": self.ok,
        }


def cache_paths(env: dict[str, str], user: str) -> list[tuple[str, str, bool]]:
    """(var, path, from its default) for each cache warmer knows; defaults as each component declares
    the library computes them when the var is unset."""
    defaults = components.default_paths(env, user)
    out = []
    for var in dict.fromkeys(v for c in components.ALL for v, _ in c.env):
        if env.get(var):
            out.append((var, env[var], False))
        elif var in defaults:
            out.append((var, defaults[var], True))
    return out


def _find_root(env: dict[str, str], resolve) -> Path | None:
    """The warmer root the env points into: where VLLM_CACHE_ROOT's parent holds a marker, or the
    mark of a root fetch prepared for a cold start (a miss: said as with --root, not passed over)."""
    v = env.get("VLLM_CACHE_ROOT")
    if v:
        parent = Path(resolve(v)).parent
        if restore.active(parent) or (parent / restore.PREPARED).is_file():
            return parent
    return None


def _locations(env, mounts, resolve, user, root: Path | None, marker) -> tuple[list[dict], list[Finding]]:
    rows, findings = [], []
    homes: list[str] = []  # where the active artifact's files lie
    if root and marker:
        homes.append(str(root))
        # The shared FlashInfer workspace the root links to lies beside it by design (README, "The
        # shared FlashInfer workspace") and holds its FlashInfer files: on the root's own filesystem
        # (both baked in the image, or on one volume) it is the artifact's as the root is. Only
        # warmer's own link counts (any other may point anywhere); on another mount it is judged alone.
        shared = workspace.Workspace.linked_from(root)
        ws = resolve(str(shared.path)) if shared else None
        if ws and mount_of(ws, mounts) is mount_of(resolve(str(root)), mounts):
            homes.append(ws)
    for var, path, default in cache_paths(env, user):
        real = resolve(path)
        m = mount_of(real, mounts)
        kind, meaning = classify(m)
        home = next((h for h in homes if under(real, h)), None)
        in_root = home is not None
        rows.append(
            {
                "var": var,
                "path": path,
                "default": default,
                "mount_point": m.mount_point if m else None,
                "fstype": m.fstype if m else None,
                "kind": kind,
                "read_only": bool(m and m.read_only),
                "in_active_root": in_root,
            }
        )
        where = f"{var}={path}" + (" (unset: its default)" if default else "")
        severity = ERROR if var in PRIMARY else WARNING
        if m and m.read_only:
            findings.append(
                Finding(
                    severity,
                    "cache-location",
                    var,
                    f"{where} is on a read-only mount ({m.mount_point}): vLLM cannot write what it compiles there",
                    f"point {var} at a writable volume (warmer's env puts it under the root)",
                )
            )
        elif kind == "container-root" or kind == "overlay":
            if in_root:
                findings.append(
                    Finding(
                        INFO,
                        "cache-location",
                        var,
                        f"{where} is inside the image (overlay), in the active artifact's "
                        + ("root" if home == str(root) else "shared FlashInfer workspace, which its root links to")
                        + ": baked in, restored with every pod",
                        "none needed; what vLLM compiles on top is lost with the pod",
                    )
                )
            else:
                findings.append(
                    Finding(
                        severity,
                        "cache-location",
                        var,
                        f"{where} is on {meaning}, so vLLM compiles from cold on every new pod",
                        FIX_VOLUME.format(var=var),
                    )
                )
        elif kind == "tmpfs":
            findings.append(
                Finding(
                    WARNING,
                    "cache-location",
                    var,
                    f"{where} is on {meaning}",
                    f"use a disk-backed emptyDir or a hostPath for {var}, or raise the "
                    "memory limit by the cache's size",
                )
            )
        elif kind == "emptydir":
            if in_root:
                findings.append(
                    Finding(
                        INFO,
                        "cache-location",
                        var,
                        f"{where} is on {meaning}; the init container fills it at each pod start",
                        "a hostPath shared by the node's pods makes later fetches no-ops",
                    )
                )
            else:
                findings.append(
                    Finding(
                        WARNING,
                        "cache-location",
                        var,
                        f"{where} is on {meaning}, and no "
                        "warmer artifact is active there: each new pod compiles from cold",
                        "fill it with `warmer fetch` in an init container (manifests/k8s/), or use a hostPath",
                    )
                )
        elif kind == "network":
            findings.append(
                Finding(
                    WARNING,
                    "cache-location",
                    var,
                    f"{where} is on {meaning}",
                    "keep caches on node-local disk (a hostPath) and fill it with "
                    "`warmer fetch`; share artifacts through the store, not the filesystem",
                )
            )
    return rows, findings


def _writable(path: str, mounts, resolve, can_write) -> tuple[bool | None, str]:
    """Whether path (or, when absent, the directory that would hold it) can be written."""
    real = resolve(path)
    m = mount_of(real, mounts)
    if m and m.read_only:
        return False, f"the mount {m.mount_point} is read-only"
    if can_write is None:
        return None, ""
    ok = can_write(real)
    return ok, "" if ok else "this user may not write there"


def _flashinfer(env, mounts, resolve, can_write, installed: bool) -> list[Finding]:
    home = env.get("HOME") or os.path.expanduser("~")
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    workspace = os.path.join(env.get("FLASHINFER_WORKSPACE_BASE") or home, components.flashinfer.CACHE)
    dirs = [
        (
            "FLASHINFER_WORKSPACE_BASE",
            workspace,
            ERROR if installed else WARNING,
            "FlashInfer writes flashinfer_jit.log there at import and takes its JIT locks in cached_ops/tmp: "
            "its import fails",
        )
    ]
    for var, default, why in (
        ("FLASHINFER_CUBIN_DIR", None, "kernel cubins are downloaded there on first use"),
        ("FLASHINFER_AUTOTUNE_CACHE_DIR", None, "autotune results are saved there"),
        ("B12X_COMPILE_CACHE_DIR", os.path.join(xdg, "b12x", "compile"), "the b12x MoE kernels compile there"),
        # Not FLASHINFER_MOE_EP_KNOB_CACHE: vLLM only reads it (components.NOT_PACKED says why), and a
        # pod with no passwd entry (HOME=/) was warned on every start of a fix warmer never applies.
    ):
        path = env.get(var) or default
        if path:
            dirs.append((var, path, WARNING, why))
    out = []
    for var, path, severity, why in dirs:
        ok, reason = _writable(path, mounts, resolve, can_write)
        if ok is False:
            out.append(
                Finding(
                    severity,
                    "flashinfer-writable",
                    var,
                    f"{path} is not writable ({reason}): {why}",
                    f"set {var} to a writable directory (warmer's env puts it under the root)",
                )
            )
    return out


def _per_pod_env(env: dict[str, str], hostnames: AbstractSet[str]) -> list[Finding]:
    out = []
    hostnames = {h for h in hostnames if h and len(h) > 2}

    def per_pod(value: str) -> str | None:
        if any(h in value for h in hostnames):
            return f"{value!r} holds this pod's hostname"
        if compat.VOLATILE_VALUE.search(value) and not compat.LOOPBACK.match(value.strip()):
            return f"{value!r} holds an IP address or a unique id"
        return None

    for name, value in sorted(env.items()):
        if name in IGNORED_BY_VLLM and name not in HASHED_BEFORE:
            continue
        pod = per_pod(value)
        if name in HASHED_PER_HOST:
            if pod:
                out.append(
                    Finding(
                        ERROR,
                        "per-pod-env",
                        name,
                        f"{name}={pod}; vLLM hashes {name} into its "
                        "compile key, so every pod gets its own key and never hits the cache",
                        f"unset {name}, or give it the same value on every pod and at build time (the recipe's [env])",
                    )
                )
            else:
                out.append(
                    Finding(
                        WARNING,
                        "per-pod-env",
                        name,
                        f"{name} is set and vLLM hashes it into its compile key: {HASHED_PER_HOST[name]}",
                        f"build with the same {name} (the recipe's [env]), or unset it",
                    )
                )
        elif name in HASHED_BEFORE and pod:
            out.append(
                Finding(
                    WARNING,
                    "per-pod-env",
                    name,
                    f"{name}={pod}: {HASHED_BEFORE[name]}",
                    "with an older vLLM, set it to a stable value (or unset it) and use "
                    "VLLM_HOST_IP, which vLLM does not hash",
                )
            )
        elif name.startswith("VLLM_") and pod and not SERVICE_LINK.fullmatch(name):
            out.append(
                Finding(
                    WARNING,
                    "per-pod-env",
                    name,
                    f"{name}={pod}; vLLM hashes every VLLM_* variable outside its ignore list into its compile key",
                    f"check that your vLLM ignores {name} (vllm/envs.py compile_factors), "
                    "or give it the same value on every pod",
                )
            )
    return out


def _artifact(
    env,
    root: Path,
    marker: restore.Marker | None,
    recipe: Recipe | None,
    node: Callable[[], Fingerprint] | None,
    exists: Callable[[str], bool] | None,
    trusted_keys: Sequence[str] = (),
) -> list[Finding]:
    if os.path.islink(root):  # not Path's: a directory above this user cannot search is judged below
        return [
            Finding(
                ERROR,
                "artifact",
                str(root),
                f"the root {root} is a symlink",
                f"use the real path {os.path.realpath(root)}: FlashInfer's ninja rebuilds what it "
                "reaches through a link",
            )
        ]
    if not marker:
        return [
            Finding(
                WARNING,
                "artifact",
                str(root),
                f"no warmer artifact is active in {root}: vLLM compiles from cold (the fetch missed, or never ran)",
                "see the init container's log (kubectl logs POD -c warmer-fetch) or run "
                "`warmer explain RECIPE --store URL` on this node",
            )
        ]
    art = marker.artifact
    if distrust := restore.distrusted(marker, trusted_keys):  # what serve and fetch with the keys do
        return [
            Finding(
                ERROR,
                "artifact",
                str(root),
                f"artifact {art.key[:16]} of recipe {art.recipe.name} is active, but {distrust}: `warmer serve` "
                f"and `warmer fetch` with these keys do not load it, vLLM compiles from cold",
                "`warmer fetch` with the keys restores a trusted artifact over it (publish one signed by them)",
            )
        ]
    out = [
        Finding(
            INFO,
            "artifact",
            str(root),
            f"artifact {art.key[:16]} of recipe {art.recipe.name} is active (restored {marker.restored_at})"
            + (f", in part: {', '.join(marker.components)}" if marker.components is not None else ""),
            "none",
        )
    ]
    # Is it in use, and will it hit: the same outlook fetch and serve give.
    look = outlook(recipe, root, art, env, node=node() if node else None, exists=exists, components=marker.components)
    return out + list(look.findings)


def _ownership(root: Path, owner: tuple[int, int] | None, active: bool) -> list[Finding]:
    """Can the serving user write what vLLM writes into the root (locks, temporary files) even on a
    full hit? If not, vLLM crashes at start-up with PermissionError."""
    problem = restore.unwritable(root, owner)
    if problem is None:
        return []
    uid, gid = owner or (os.geteuid(), os.getegid())
    if active and restore.unwritable(root, owner, creatable=True) is None:
        return [  # what serve makes before vLLM starts (serving.plan), and fetch whenever it runs
            Finding(
                WARNING,
                "ownership",
                str(root),
                f"{problem}: `warmer serve` makes it before vLLM starts (uid {uid} may); vLLM started another "
                "way makes its cache directories, but a TMPDIR that does not exist is replaced by /tmp, "
                "where Inductor's precompiled headers are not kept",
                "run `warmer fetch` again (it makes every cache directory of the root), or start vLLM with "
                "`warmer serve`",
            )
        ]
    return [
        Finding(
            ERROR,
            "ownership",
            str(root),
            f"{problem}: uid {uid}, which vLLM runs as, cannot write it; torch "
            "and vLLM write lock and temporary files into the root even on a full hit, so vLLM exits with "
            "PermissionError (`warmer serve` starts it cold elsewhere instead)",
            restore.ownership_fix(root, (uid, gid)).removeprefix("Fix: "),
        )
    ]


def diagnose(
    env: dict[str, str],
    mountinfo: str,
    *,
    root: Path | None = None,
    recipe: Recipe | None = None,
    resolve: Callable[[str], str] = os.path.normpath,
    can_write: Callable[[str], bool] | None = None,
    exists: Callable[[str], bool] | None = None,
    node: Callable[[], Fingerprint] | None = None,
    user: str = "root",
    hostnames: AbstractSet[str] = frozenset(),
    flashinfer_installed: bool = True,
    owner: tuple[int, int] | None = None,
    trusted_keys: Sequence[str] = (),
) -> Diagnosis:
    """Every check on the given inputs. resolve maps a path to the one mountinfo shows (realpath
    on this machine, normpath for a sample); can_write and exists probe this machine (None: only
    mountinfo's read-only flags count); node returns this node's fingerprint; owner: the (uid,
    gid) vLLM runs as, when it is not this process (doctor --pid); trusted_keys: as serve's."""
    mounts = parse_mountinfo(mountinfo)
    root = Path(os.path.abspath(root)) if root else _find_root(env, resolve)
    marker = restore.active(root) if root else None
    rows, findings = _locations(env, mounts, resolve, user, root, marker)
    findings += _flashinfer(env, mounts, resolve, can_write, flashinfer_installed)
    findings += _per_pod_env(env, set(hostnames) | {env.get("HOSTNAME", "")})
    if root:
        # on this machine, as fetch decides it (a mount the table lists may be hidden by a later one)
        if (
            restore.mount_point_at(root)
            if can_write is not None
            else any(m.mount_point == resolve(str(root)) for m in mounts)
        ):
            findings.append(  # fetch and build refuse it (restore.check_root): said before the pod fails
                Finding(
                    ERROR,
                    "root",
                    str(root),
                    f"the root {root} is a mount point: a restore builds the new root beside it and renames it "
                    "into place, which a mount point refuses, so fetch and build stop with a usage error",
                    restore.mount_point_fix(root),
                )
            )
        findings += _artifact(env, root, marker, recipe, node, exists, trusted_keys)
        try:
            there = root.is_dir()
        except PermissionError:  # a directory above it this user cannot search: _ownership names it
            there = True
        if can_write is not None and there:  # this machine's files, not a saved sample's
            findings += _ownership(root, owner, marker is not None)
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    findings.sort(key=lambda f: order[f.severity])
    return Diagnosis(str(root) if root else None, tuple(rows), tuple(findings))


def _can_write(path: str) -> bool:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.access(p, os.W_OK, effective_ids=True)  # as the writes will be judged (restore.unwritable)


def read_process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (ProcessLookupError, FileNotFoundError):  # a zombie, or reaped: its env is no longer shown
        raise UsageError(f"process {pid} has exited: pass the pid of the running vLLM, or --env-file") from None
    except OSError as e:
        raise UsageError(
            f"cannot read the env of process {pid} ({e.strerror}): run doctor as its user, or pass --env-file"
        ) from None
    if not raw:  # what the kernel shows of a process inside its execve, or started with env -i
        raise UsageError(
            f"process {pid} shows no environment (it is just starting, or was started with an empty one): "
            "pass the pid of the running vLLM, or --env-file with the env it starts with"
        )
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def diagnose_here(
    *,
    root: str | None = None,
    recipe: Recipe | None = None,
    env_file: str | None = None,
    pid: int | None = None,
    mountinfo_file: str | None = None,
    trusted_keys: Sequence[str] = (),
) -> Diagnosis:
    """diagnose() on this machine: the env of this process (or of pid), plus env_file on top (what
    vLLM starts with), and /proc/self/mountinfo unless a saved one is given."""
    env = read_process_env(pid) if pid is not None else dict(os.environ)
    owner = _process_ids(pid) if pid is not None else None
    if env_file:
        try:
            text = Path(env_file).read_text(errors="replace")
        except OSError as e:
            raise UsageError(f"cannot read the env file {env_file}: {e.strerror}") from None
        env.update(EnvFile.parse(text, env_file).vars)
    sample = mountinfo_file is not None
    try:
        text = Path(mountinfo_file or "/proc/self/mountinfo").read_text(errors="replace")
    except OSError as e:
        raise UsageError(
            f"cannot read the mount table {mountinfo_file or '/proc/self/mountinfo'}: {e.strerror}"
        ) from None
    model = recipe.model if recipe else None
    return diagnose(
        env,
        text,
        root=Path(root) if root else None,
        recipe=recipe,
        # A saved mountinfo comes from elsewhere: this machine's symlinks and
        # permissions say nothing about it.
        resolve=os.path.normpath if sample else os.path.realpath,
        can_write=None if sample else _can_write,
        exists=None if sample else os.path.exists,
        # the GPUs vLLM's env picks (CUDA_VISIBLE_DEVICES), not this shell's
        node=None if sample else (lambda: fingerprint.probe(root=root, model=model, gpu_env=env)),
        user=user_name(env, owner[0] if owner else None),
        hostnames={socket.gethostname()} if not sample else set(),
        flashinfer_installed=sample or importlib.util.find_spec("flashinfer") is not None,
        owner=owner,
        trusted_keys=trusted_keys,
    )


def _process_ids(pid: int) -> tuple[int, int] | None:
    """The effective (uid, gid) of process pid, from /proc/PID/status."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
        )
        return int(fields["Uid"].split()[1]), int(fields["Gid"].split()[1])
    except (OSError, KeyError, ValueError, IndexError):
        return None
