"""docs/architecture.md stays true: every path it names exists, and the leaves import nothing above them."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"

# What a leaf (archive, store, fingerprint) may import of warmer: the error model and other leaves.
LEAF_MAY_IMPORT = ("warmer.errors", "warmer.untrusted", "warmer.deadline", "warmer.atomic", "warmer.names",
                   "warmer.archive", "warmer.store")


def named_paths() -> list[str]:
    return sorted(set(re.findall(r"`((?:warmer|docs|tests)/[\w./-]+)`", DOC.read_text())))


def test_the_page_names_the_floors_and_where_new_things_go():
    text = DOC.read_text()
    for heading in ("The domain", "Stores and the archive", "The node journey", "The build journey", "Interfaces",
                    "Where new things go"):
        assert f" {heading}" in text, heading
    assert len(named_paths()) > 30, "the page names the modules of each floor"


@pytest.mark.parametrize("path", named_paths())
def test_every_module_the_page_names_exists(path):
    assert (REPO / path).exists(), f"docs/architecture.md names {path}, which is gone: update the page"


def _warmer_imports(source: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("warmer"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("warmer")}
    return out


LEAVES = [*sorted((REPO / "warmer/archive").glob("*.py")), *sorted((REPO / "warmer/store").rglob("*.py")),
          REPO / "warmer/fingerprint.py"]


@pytest.mark.parametrize("leaf", LEAVES, ids=lambda p: str(p.relative_to(REPO)))
def test_leaves_import_nothing_above_them(leaf):
    above = {m for m in _warmer_imports(leaf)
             if m != "warmer" and not any(m == ok or m.startswith(ok + ".") for ok in LEAF_MAY_IMPORT)}
    # `from warmer import errors` names the module itself: allowed when it is one of the leaves' own.
    above = {m for m in above if m.removeprefix("warmer.") not in ("errors", "untrusted", "deadline", "atomic", "names")}
    assert not above, f"{leaf.relative_to(REPO)} imports {sorted(above)}, above the leaves"
