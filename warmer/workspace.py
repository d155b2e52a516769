"""The node's shared FlashInfer workspace: one per root base and FlashInfer toolchain, for every recipe.

FlashInfer reuses a JIT module only when ninja finds nothing to do, and build.ninja holds the
workspace's absolute path (flashinfer/jit/cpp_ext.py), so a module built for one recipe serves
another only at the same path. A build therefore makes its root's flashinfer/ a link to
W = <root base>/.flashinfer/<key>/ws, key being what the modules' compile commands depend on
(the FlashInfer contract without the workspace); FLASHINFER_WORKSPACE_BASE is W's real path at
build and at serve (components/flashinfer.py JitWorkspace.env_under).

On a node, W is a union of units, each from one artifact (its origin): a JIT module (its
cached_ops/<m>/ and its generated/<m> sources) or any other file on its own. The origin's
artifact.json is kept beside W (origins/<id>.json, named by its sha256, and its signature), and a
unit is intact when its files are the ones that artifact lists. An intact unit is never replaced:
another build of the same key compiled it with the same commands, so it serves every recipe, and a
second recipe whose units W holds intact downloads nothing for its FlashInfer layer.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from warmer import archive, signing
from warmer.archive import FileEntry
from warmer.artifact import Artifact, ArtifactError
from warmer.components import flashinfer
from warmer.untrusted import Fields, InvalidDocument, load_json

SHARED = ".flashinfer"  # beside the roots: one directory per key
WS = "ws"  # FLASHINFER_WORKSPACE_BASE inside it
ASIDE = "ws.aside-"  # what W held while a build warms from cold (Workspace.set_aside), beside it
PREFIX = flashinfer.SUBDIR + "/"  # a root-relative path into the workspace
_KEY = re.compile(r"[0-9a-f]{16}")
# A JIT module's files: <version>/<arch>/cached_ops/<m>/... and <version>/<arch>/generated/<m>[/...|.ext], and
# a trtllm-gen module's generated/trtllm_export/<m>/... (its headers: flashinfer/jit/fused_moe.py, gemm/core.py)
_MODULE = re.compile(
    r"^(flashinfer/\.cache/flashinfer/[^/]+/[^/]+/)(?:cached_ops/|generated/(?:trtllm_export/)?)([^/.]+)"
)
TRTLLM_EXPORT = "trtllm_export"
MAX_UNITS_BYTES = 64 << 20


def key(contract: flashinfer.FlashInferContract) -> str:
    """What every module's compile command depends on, but the workspace itself: FlashInfer's,
    tvm-ffi's and Python's paths, CUDA_HOME, nvcc's version, ninja and the compile-affecting env
    (a contract without nvcc, as before it was recorded, keys as it did)."""
    doc = {k: v for k, v in contract.to_json().items() if k not in ("workspace_base", "modules", "links")}
    if doc.get("nvcc") is None:
        doc.pop("nvcc", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def unit_of(rel: str) -> str:
    """The unit a root-relative workspace path belongs to: its JIT module, or the file itself."""
    m = _MODULE.match(rel)
    return f"{m.group(1)}cached_ops/{m.group(2)}" if m else rel


def units(entries: Iterable[FileEntry]) -> dict[str, list[FileEntry]]:
    out: dict[str, list[FileEntry]] = {}
    for e in entries:
        if e.path.startswith(PREFIX):
            out.setdefault(unit_of(e.path), []).append(e)
    return out


def link(root: Path, contract: flashinfer.FlashInferContract) -> Path:
    """A build's root: its flashinfer/ made a link to the shared workspace of contract's key. Returns W."""
    top = root.parent / SHARED / key(contract)
    (top / WS).mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    here = root / flashinfer.SUBDIR
    if not os.path.lexists(here):
        here.symlink_to(target(top.name))
    return top / WS


def target(name: str) -> str:
    """The link a root's flashinfer/ holds, relative: roots and the shared directory sit side by side."""
    return f"../{SHARED}/{name}/{WS}"


@dataclass(frozen=True)
class Workspace:
    """A shared workspace: top (<root base>/.flashinfer/<key>), W = top/ws, and its records."""

    top: Path

    @property
    def path(self) -> Path:
        return self.top / WS

    @classmethod
    def of(cls, art: Artifact, root: Path) -> Workspace | None:
        """The shared workspace art's FlashInfer files were built in, when it is the one beside root
        on this node (the same root base); None for an artifact built in its root (as before)."""
        fi = art.path_contract.flashinfer
        if fi is None:
            return None
        built = Path(fi.workspace_base)
        base = Path(os.path.realpath(root.parent)) / SHARED
        if built.name != WS or built.parent.parent != base or not _KEY.fullmatch(built.parent.name):
            return None
        return cls(base / built.parent.name)

    @classmethod
    def linked_from(cls, root: Path) -> Workspace | None:
        """The shared workspace root's flashinfer/ links to, when it is the link warmer makes
        (link, target); None for a directory or any other link."""
        try:
            name = Path(os.readlink(root / flashinfer.SUBDIR)).parent.name
        except OSError:
            return None
        ws = cls(Path(os.path.realpath(root.parent)) / SHARED / name)
        return ws if _KEY.fullmatch(name) and ws.linked(root) else None

    def linked(self, root: Path) -> bool:
        """Whether root's flashinfer/ is the link to this workspace."""
        here = root / flashinfer.SUBDIR
        return here.is_symlink() and os.readlink(here) == target(self.top.name)

    # -- the records: which artifact each unit came from ----------------------------------------

    def _records(self) -> dict[str, str]:
        try:
            with open(self.top / "units.json", "rb") as f:
                data = f.read(MAX_UNITS_BYTES + 1)
            return Fields(load_json(data, what="units.json", max_bytes=MAX_UNITS_BYTES), "units.json").str_map("units")
        except (OSError, InvalidDocument):
            return {}

    def _write_records(self, records: dict[str, str]) -> None:
        _write(self.top.parent, self.top / "units.json", json.dumps({"units": records}, sort_keys=True).encode())

    def _origin(self, art_id: str, trusted_keys: tuple) -> Artifact | None:
        """The origin artifact kept beside W, when its bytes hash to its name (and, with trusted keys,
        its signature verifies): else None, and its units count as not intact."""
        if not re.fullmatch(r"[0-9a-f]{64}", art_id):
            return None
        try:
            art = Artifact.from_bytes((self.top / "origins" / f"{art_id}.json").read_bytes(), f"origin {art_id}")
            if art.id != art_id:
                return None
            if trusted_keys:
                sig = signing.Signature.from_json(
                    json.loads((self.top / "origins" / f"{art_id}.sig.json").read_text()), "signature"
                )
                signing.verify(art.canonical, sig, list(trusted_keys))
        except (OSError, ValueError, ArtifactError, InvalidDocument, signing.SignatureError):
            return None
        return art

    # -- coverage -------------------------------------------------------------------------------

    def missing(
        self, entries: Iterable[FileEntry], *, hashed: bool, trusted_keys: tuple = (), known: Artifact | None = None
    ) -> list[str]:
        """The units of entries (an artifact's workspace files) that W does not hold intact: absent,
        without a readable origin, or not the files their origin lists (hashed: by sha256, else by
        size). A unit from another artifact counts when it holds every path entries give it. known:
        an artifact the caller has already checked (the one restored, a marker's), not read again
        from its copy beside W when it is a unit's origin."""
        return list(self._lacking(entries, hashed, trusted_keys, known))

    def holds(self, entries: Iterable[FileEntry], *, trusted_keys: tuple = (), known: Artifact | None = None) -> bool:
        """Whether W holds every unit of entries intact, by sha256; stops at the first it lacks."""
        return next(self._lacking(entries, True, trusted_keys, known), None) is None

    def _lacking(
        self, entries: Iterable[FileEntry], hashed: bool, trusted_keys: tuple, known: Artifact | None
    ) -> Iterator[str]:
        records = self._records()
        origins: dict[str, dict[str, list[FileEntry]]] = {}  # each origin's units, read once
        if known is not None:
            origins[known.id] = units(known.files)
        for unit, wanted in units(entries).items():
            art_id = records.get(unit, "")
            if art_id not in origins:
                origin = self._origin(art_id, trusted_keys) if art_id else None
                origins[art_id] = units(origin.files) if origin else {}
            held = origins[art_id].get(unit, [])
            lacks = not held or {e.path for e in wanted} - {e.path for e in held}
            if lacks or not self._intact(held, hashed, bool(trusted_keys)):
                yield unit

    def _intact(self, held: list[FileEntry], hashed: bool, trusted: bool) -> bool:
        # ninja's rebuild is the node's own code, which no key signed: with keys, the signed copy goes back
        rebuilt = not trusted and self._rebuilt_here(held)
        for e in held:
            path = self.path / e.path[len(PREFIX) :]
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                return False
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return False
                if rebuilt:
                    continue
                if st.st_size != e.size or (hashed and archive.copy_hashed(f)[0] != e.sha256):
                    return False
        return True

    def _rebuilt_here(self, held: list[FileEntry]) -> bool:
        """Whether FlashInfer's ninja rebuilt this module here after its origin's files were put in
        (an input newer than they are: a node image rebuilt with the same pins). ninja appends to the
        module's .ninja_log, so the log begins with the origin's and goes on. That build serves this
        node; the origin's copy put back would be rebuilt at every start."""
        log = next((e for e in held if e.path.endswith("/.ninja_log")), None)
        if log is None:
            return False
        try:
            fd = os.open(
                self.path / log.path[len(PREFIX) :], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            return False
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            head = f.read(log.size)
            return len(head) == log.size and f.read(1) != b"" and hashlib.sha256(head).hexdigest() == log.sha256

    # -- adoption: an extracted artifact's workspace files moved into W --------------------------

    def adopt(
        self,
        staged: Path,
        art: Artifact,
        signature: signing.Signature | None,
        trusted_keys: tuple = (),
    ) -> list[str]:
        """Move the units of art that W lacks (or holds damaged) from staged (the extracted flashinfer/
        directory, each file checked already) into W, and record art as their origin; units W holds
        intact stay as they are. A module that a running vLLM is building now (it holds FlashInfer's
        lock of that module) is left to it: that build has the same commands. The caller holds W's
        lock. Returns the units left so, moved in by a later restore."""
        wanted = units(art.files)
        if not staged.is_dir():
            return []
        bad = set(self.missing(art.files, hashed=True, trusted_keys=trusted_keys, known=art))
        moved = [u for u in wanted if u in bad and all((staged / e.path[len(PREFIX) :]).is_file() for e in wanted[u])]
        if not moved:
            return []
        origins = self.top / "origins"
        _write(self.top.parent, origins / f"{art.id}.json", art.canonical)
        if signature is not None:
            _write(self.top.parent, origins / f"{art.id}.sig.json", json.dumps(signature.to_json()).encode())
        records, building = self._records(), []
        for unit in moved:
            with self._flashinfer_lock(unit) as free:
                if not free:
                    building.append(unit)
                    continue
                self._clear(unit)
                for e in wanted[unit]:
                    rel = Path(e.path[len(PREFIX) :])
                    with _opened(self.top.parent, (self.path / rel).parent) as fd:  # no link followed (_opened)
                        os.replace(staged / rel, rel.name, dst_dir_fd=fd)
            records[unit] = art.id
        self._write_records(records)
        return building

    @contextmanager
    def _flashinfer_lock(self, unit: str) -> Iterator[bool]:
        """FlashInfer's own lock of a module (flashinfer/jit/core.py: JitSpec.lock_path is
        cached_ops/tmp/<m>.lock, a flock that build_and_load holds while it builds and loads), taken
        without waiting while the module's files are replaced, so that a vLLM building it is never
        cut off: False while another process holds it. Any other unit is one file, replaced atomically."""
        m = _MODULE.match(unit)
        if m is None:
            yield True
            return
        with _opened(self.top.parent, self.path / m.group(1)[len(PREFIX) :] / "cached_ops" / "tmp") as tmp:
            fd = os.open(f"{m.group(2)}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=tmp)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free = False
            else:
                free = True
            yield free
        finally:
            os.close(fd)  # and with it the lock

    def real_dir(self, path: Path) -> Path:
        """path, made a directory one level at a time from the root base's .flashinfer/ down, each
        level a real directory: W is writable by every pod of the node, and a link planted in it
        would send what a restore (run as root) moves or removes anywhere. ArchiveError if one is not."""
        return _real_dir(self.top.parent, path)

    def _clear(self, unit: str) -> None:
        """What W holds of unit, removed before another copy moves in (a module: its build directory
        and generated sources, whatever files they hold)."""
        rel = unit[len(PREFIX) :]
        m = _MODULE.match(unit)
        if m is None:
            with _opened(self.top.parent, (self.path / rel).parent) as fd, suppress(FileNotFoundError):
                os.unlink(Path(rel).name, dir_fd=fd)
            return
        base, name = self.path / m.group(1)[len(PREFIX) :], m.group(2)
        # Each removed through its directory's fd, opened level by level without following a link: a pod
        # that swaps a directory of W for a link after it was opened sends nothing a root restore removes
        # outside W.
        dirs = [base / "cached_ops", base / "generated"]
        if os.path.lexists(base / "generated" / TRTLLM_EXPORT):
            dirs.append(base / "generated" / TRTLLM_EXPORT)
        for d in dirs:
            with _opened(self.top.parent, d) as fd:
                for entry in os.listdir(fd):
                    st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                    if entry == name and stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(entry, dir_fd=fd)
                    elif entry.startswith(f"{name}.") and d.name == "generated":
                        os.unlink(entry, dir_fd=fd)

    # -- a build on a builder: W emptied for its warm-up, what W held merged back after its pack --

    def set_aside(self) -> Path | None:
        """Move what W holds out of the way (another recipe's modules, an earlier build's), so that a
        build's warm-up compiles every module its recipe needs and its pack holds just those. Returns
        where it went (None: W held nothing); what an interrupted build set aside is merged back
        first. The caller holds W's lock until merge_back."""
        for left in sorted(self.top.glob(ASIDE + "*")):
            self.merge_back(left)
        with os.scandir(self.real_dir(self.path)) as entries:
            if next(entries, None) is None:
                return None
        aside = self.top / f"{ASIDE}{uuid.uuid4().hex[:12]}"
        os.rename(self.path, aside)
        os.mkdir(self.path)
        return aside

    def merge_back(self, aside: Path) -> None:
        """What set_aside moved out, back into W unit by unit: a unit the build made again stays the
        build's and loses its record (its origin lists the set-aside bytes); the others move back."""
        made = {unit_of(PREFIX + rel) for rel in _files(self.path)}
        # Both ends through fds, no link followed (fwalk, _opened): aside and W are writable by every pod of
        # the node, and a directory of either swapped for a link would move files from or to anywhere.
        with _opened(self.top.parent, aside) as top:
            for dirpath, _, filenames, src in os.fwalk(".", dir_fd=top):
                for name in filenames:
                    rel = os.path.normpath(os.path.join(dirpath, name))
                    if unit_of(PREFIX + rel) not in made:
                        with _opened(self.top.parent, (self.path / rel).parent) as dst:
                            os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)
        records = self._records()
        if made & records.keys():
            self._write_records({u: art_id for u, art_id in records.items() if u not in made})
        shutil.rmtree(aside)


def make_links(ws: Path, contract: flashinfer.FlashInferContract | None, base: Path) -> None:
    """FlashInfer's links (contract.links) in the workspace ws, as FlashInfer makes them before it runs
    ninja (flashinfer/jit/cubin_loader.py ensure_symlink): ninja's deps name the trtllm-gen export
    headers through them, so without them warmer's dry run calls the modules dirty, and verify counts
    the headers FlashInfer links in as new files. Each is relative, to its target in ws's cubin dir
    (FlashInfer keeps a link that resolves to its target); a path that holds anything already is left
    as it is (FlashInfer replaces a stale one itself). Its directories are made from base down, each
    a real directory (_opened)."""
    if contract is None:
        return
    cache = ws / flashinfer.CACHE
    for rel, target in contract.links.items():
        link = cache / rel
        # made in that directory even if a pod swaps it for a link now
        with _opened(base, link.parent) as fd, suppress(FileExistsError):
            os.symlink(os.path.relpath(cache / "cubins" / target, link.parent), link.name, dir_fd=fd)


def _real_dir(base: Path, path: Path) -> Path:
    """path under base, made a directory one level at a time from base down, each level a real
    directory (Workspace.real_dir). ArchiveError if one is not."""
    for part in (base, *reversed([p for p in path.parents if p.is_relative_to(base) and p != base]), path):
        try:
            os.mkdir(part)
        except FileExistsError:
            pass
        st = os.lstat(part)
        if not stat.S_ISDIR(st.st_mode):
            raise archive.ArchiveError(
                f"{part} in the shared FlashInfer workspace is not a directory "
                f"({stat.filemode(st.st_mode)}): warmer never makes one; remove it"
            )
    return path


@contextmanager
def _opened(base: Path, path: Path) -> Iterator[int]:
    """An fd of path under base, made a directory one level at a time from base down, each level
    opened through the one above without following a link (O_NOFOLLOW), closed after: unlike
    _real_dir's path, what is done through it stays in that directory when a pod (W is writable by
    every pod of the node) swaps one of its levels for a link after the check. ArchiveError if one
    is not a directory."""
    fd = os.open(_real_dir(base, base), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for i, part in enumerate(path.relative_to(base).parts):
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                raise archive.ArchiveError(
                    f"{base.joinpath(*path.relative_to(base).parts[: i + 1])} in the shared FlashInfer workspace "
                    f"is not a directory ({stat.filemode(st.st_mode)}): warmer never makes one; remove it"
                ) from None
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


def _files(top: Path) -> Iterator[str]:
    """Every path under top that is not a directory, relative to it (links are not followed)."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            yield os.path.relpath(os.path.join(dirpath, name), top)


def _write(base: Path, path: Path, data: bytes) -> None:
    """data as path under base, through a new file renamed over it, in path's directory opened by
    _opened: never written through a link planted there, nor into a directory swapped for one."""
    tmp = f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
    with _opened(base, path.parent) as d:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=d)
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path.name, src_dir_fd=d, dst_dir_fd=d)
