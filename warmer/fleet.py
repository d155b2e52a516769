"""Node bootstrap at the node: every recipe this node's SKU serves, fetched before any pod asks.

`warmer fetch --all MANIFESTS --root-base DIR` reads the SKU catalogue (skus.toml) and the
recipes beside it, finds the SKUs this node is (by its fingerprint), and fetches each recipe that
targets one of them into DIR/RECIPE, a few at a time. A prefetch DaemonSet or a systemd unit runs
it when a node joins and again on a timer; the pods' own init containers then find their recipe
already active (a no-op in milliseconds). Each fetch is fetch.fetch: a miss is a result, never
an error. `--metrics-file` writes the outcome as node_exporter textfile-collector metrics.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from warmer import fetch, fingerprint, matrix, restore
from warmer.atomic import write_bytes
from warmer.deadline import Deadline
from warmer.errors import UsageError
from warmer.recipe import Recipe, parse, read_doc
from warmer.store import open_store


@dataclass(frozen=True)
class Outcome:
    recipe: str
    root: str
    result: fetch.FetchResult | None  # None: not fetched (skipped, or a bad recipe file)
    seconds: float
    why_skipped: str | None = None
    bad_recipe: str | None = None  # why the recipe file could not be used: the others still fetch
    bad_root: str | None = None  # why ROOT_BASE/RECIPE cannot be a root (a file, a link): the others still fetch

    @property
    def status(self) -> str:
        if self.bad_recipe or self.bad_root:
            return "bad-recipe" if self.bad_recipe else "bad-root"
        return "skipped" if self.result is None else self.result.status

    def line(self) -> str:
        if self.bad_recipe or self.bad_root:
            return f"{self.recipe}: {self.status}, not fetched: {self.bad_recipe or self.bad_root}"
        if self.result is None:
            return f"{self.recipe}: skipped ({self.why_skipped})"
        r = self.result
        tail = ""
        if not r.hit:
            tail = f": {r.warnings[-1]}" if r.warnings else ""
        return f"{self.recipe}: {r.status} in {self.seconds:.1f} s, root {self.root}{tail}"

    def to_json(self) -> dict:
        doc = {"recipe": self.recipe, "root": self.root, "seconds": round(self.seconds, 3)}
        if self.bad_recipe or self.bad_root:
            doc.update(status=self.status, why=self.bad_recipe or self.bad_root)
        elif self.result is None:
            doc.update(status="skipped", why=self.why_skipped)
        else:
            doc.update(self.result.to_json())
        return doc


def recipes_for_node(
    manifests: Path, node, *, skus: Path | None = None
) -> tuple[list[Recipe], list[tuple[str, str]], list[tuple[str, str]]]:
    """(recipes that target a SKU this node is, [(recipe, why skipped)] for the others, [(recipe,
    or its file's name where the name cannot be read, why it cannot be used)]). One bad file
    (invalid TOML, a link out of the directory, a FIFO, 100 MB) is one line, never the end of the
    others: on a DaemonSet, a broken ConfigMap entry must not turn every recipe of every node cold."""
    catalogue = skus or matrix.find_catalogue([manifests])
    catalogue_skus = matrix.load_skus(catalogue)
    mine = {name for name, sku in catalogue_skus.items() if sku.matches(node)}
    chosen, skipped, bad = [], [], []
    for f in matrix.recipe_files([manifests]):
        # Whose recipe it is comes from its TOML alone, as for `warmer matrix`: a recipe for another
        # SKU (or for none) is skipped even where its ${VAR}s are not set, never a bad recipe here.
        try:
            doc, text = read_doc(f, within=f.parent)
            name, targets = matrix.name_and_targets(doc, f)
        except UsageError as e:
            bad.append((f.stem, str(e)))
            continue
        if not mine & set(targets):
            skipped.append(
                (
                    name,
                    f"targets {', '.join(targets) or 'no SKU'}; this node is "
                    f"{', '.join(sorted(mine)) or 'no SKU in ' + str(catalogue)}",
                )
            )
            continue
        try:
            chosen.append(parse(doc, f, text))
        except UsageError as e:  # this node's recipe, and unusable here: the operator's to fix
            bad.append((name, str(e)))
    # Two files of one name would fetch into one root, each round swapping one in for the other (and
    # repeat the name's metrics, which node_exporter refuses): neither is fetched, as `warmer matrix` refuses them.
    # A bad file of a fetched one's name repeats it too: one outcome per name, whatever number of files.
    files: dict[str, list[str]] = {}
    for r in chosen:
        files.setdefault(r.name, []).append(str(r.source))
    why: dict[str, list[str]] = {}
    for name, text in bad:
        why.setdefault(name, []).append(text)
    twice = {name: paths for name, paths in files.items() if len(paths) > 1 or name in why}
    for name, paths in twice.items():
        are = "are all" if len(paths) > 1 else "is"
        why.setdefault(name, []).append(f"{' and '.join(paths)} {are} named {name!r}: recipe names must be unique")
    return [r for r in chosen if r.name not in twice], skipped, [(name, "; ".join(t)) for name, t in why.items()]


def fetch_all(
    manifests: Path,
    store_url: str,
    root_base: Path,
    *,
    parallel: int = 2,
    skus: Path | None = None,
    store_options: dict | None = None,
    deadline: Deadline | None = None,
    **fetch_options,
) -> list[Outcome]:
    """Fetch every recipe for this node's SKU into root_base/RECIPE, `parallel` at a time, all of
    it by the deadline (each recipe's fetch ends by it, a miss past it). An interrupt (SIGTERM,
    Ctrl-C) cancels the fetches under way: each leaves its root as it was."""
    deadline = deadline or Deadline(what="fetch --all")
    # bounded too (a wedged driver's NVML answers never): past the deadline, the run fails and says so
    node = deadline.call(fingerprint.probe, "probing this node's GPUs and libraries")
    chosen, skipped, bad = recipes_for_node(manifests, node, skus=skus)
    root_base = Path(root_base).absolute()
    store_options = store_options or {}
    if isinstance(store_url, str):
        open_store(store_url, **store_options)  # a malformed URL is the operator's: UsageError once, up front

    def one(recipe: Recipe) -> Outcome:
        t0 = time.perf_counter()
        root = root_base / recipe.name
        try:  # one recipe's root that cannot be one is that recipe's outcome, never the others' end
            restore.check_root(root)
        except UsageError as e:
            return Outcome(recipe.name, str(root), None, 0.0, bad_root=str(e))
        result = fetch.fetch(
            recipe,
            store_url,
            root,
            store_options=store_options,
            deadline=deadline.child(f"fetch of {recipe.name}"),
            **fetch_options,
        )
        return Outcome(recipe.name, str(root), result, time.perf_counter() - t0)

    pool = ThreadPoolExecutor(max(1, parallel))
    try:
        done = list(pool.map(one, chosen))
    except BaseException:
        deadline.cancel()  # the fetches under way stop within a second or two and keep their roots
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    listed = {r.name for r in chosen} | {name for name, _ in (*bad, *skipped)}
    return (
        done
        + [Outcome(name, str(root_base / name), None, 0.0, bad_recipe=why) for name, why in bad]
        + [Outcome(name, str(root_base / name), None, 0.0, why) for name, why in skipped]
        # a file that could not be read may name any recipe: no root is called retired then
        + ([] if bad else _unlisted(root_base, listed))
    )


def _unlisted(root_base: Path, listed: set[str]) -> list[Outcome]:
    """The roots of recipes no manifest names any more (a model retired): said, with what they hold,
    never removed here: a pod may still serve from one."""
    try:
        dirs = sorted(p for p in root_base.iterdir() if p.name not in listed and not p.name.startswith("."))
    except OSError:
        return []
    out = []
    for d in dirs:
        marker = restore.active(d)
        if not _a_root(d, marker):
            continue
        held = f"{marker.bytes_held / 1e6:.0f} MB active" if marker else "no artifact active"
        why = f"no manifest names it any more: its root stays ({held}); remove it (`rm -rf {d}`) once no pod serves it"
        out.append(Outcome(d.name, str(d), None, 0.0, why))
    return out


def _a_root(d: Path, marker: restore.Marker | None) -> bool:
    """Whether d is a root of warmer's: one holding an artifact, or prepared for a cold start."""
    try:
        return marker is not None or (d.is_dir() and not d.is_symlink() and (d / restore.PREPARED).is_file())
    except OSError:  # a folder this user cannot enter (lost+found): not a root of warmer's
        return False


def metrics(outcomes: list[Outcome], ran: bool = True) -> str:
    """node_exporter textfile-collector metrics (Prometheus text format) of fetch outcomes, each
    family's lines together. ran=False: the run itself failed (its probe, its catalogue, its store
    URL): no recipe's outcome is known, and a success of 0 says so where the last run's would linger."""
    statuses = (*fetch.STATUSES, "bad-recipe", "bad-root")
    shown = [o for o in outcomes if o.status != "skipped"]

    def label(o: Outcome) -> str:  # a file name that is not UTF-8 is said in escapes, not a crash
        text = o.recipe.encode("utf-8", "backslashreplace").decode()
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    def held(o: Outcome) -> int:  # what vLLM is pointed at: a held artifact the fetch refused counts 0
        marker = restore.active(Path(o.root)) if o.status in (*restore.ACTIVE, restore.PARTIAL) else None
        return marker.bytes_held if marker else 0

    families = [
        (
            "warmer_fetch_run_success",
            "1 when the last warmer fetch run ended, 0 when it failed as a whole.",
            [f"warmer_fetch_run_success {int(ran)}"],
        ),
        (
            "warmer_fetch_last_run_timestamp_seconds",
            "When the last warmer fetch run ended (Unix time).",
            [f"warmer_fetch_last_run_timestamp_seconds {time.time():.0f}"],
        ),
        (
            "warmer_fetch_seconds",
            "Seconds the last warmer fetch of a recipe took.",
            [f'warmer_fetch_seconds{{recipe="{label(o)}"}} {o.seconds:.3f}' for o in shown],
        ),
        (
            "warmer_artifact_bytes",
            "Bytes of cache the artifact vLLM is pointed at for a recipe holds (0: none).",
            [f'warmer_artifact_bytes{{recipe="{label(o)}"}} {held(o)}' for o in shown],
        ),
        (
            "warmer_fetch_status",
            "1 for the outcome of the last warmer fetch of a recipe, 0 for the others.",
            [
                f'warmer_fetch_status{{recipe="{label(o)}",status="{s}"}} {int(o.status == s)}'
                for o in shown
                for s in statuses
            ],
        ),
    ]
    lines = []
    for name, about, samples in families:
        lines += [f"# HELP {name} {about}", f"# TYPE {name} gauge", *samples]
    return "\n".join(lines) + "\n"


def write_metrics(path: Path, outcomes: list[Outcome], ran: bool = True) -> None:
    # The collector reads *.prom files whenever it scrapes: replace the file whole, never partly.
    write_bytes(path, metrics(outcomes, ran).encode())


@dataclass(frozen=True)
class LocalRoot:
    """A root on this node: which artifact is active there and whether it still fits the node."""

    recipe: str
    root: str
    key: str | None
    bytes: int
    restored_at: str | None
    fits: bool | None
    why_not: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {**vars(self), "why_not": list(self.why_not)}


def local_roots(root_base: Path, deadline: Deadline | None = None) -> list[LocalRoot]:
    """Every root under root_base (one per recipe), active or not."""
    from warmer import compat

    node = (deadline or Deadline(what="ls --root-base")).call(
        fingerprint.probe, "probing this node's GPUs and libraries"
    )
    out = []
    for d in sorted(p for p in Path(root_base).iterdir() if p.is_dir() and not p.name.startswith(".")):
        marker = restore.active(d)
        if not _a_root(d, marker):  # lost+found, someone's own directory
            continue
        if marker is None:
            out.append(LocalRoot(d.name, str(d), None, 0, None, None))
            continue
        art = marker.artifact
        bad = [x.line() for x in compat.held_misfits(art.fingerprint, node, art.recipe.identity, marker.components)]
        out.append(
            LocalRoot(art.recipe.name, str(d), art.key, marker.bytes_held, marker.restored_at, not bad, tuple(bad))
        )
    return out
