"""The cache census: every place the installed libraries put an on-disk cache is covered.

It reads the installed sources of vLLM, FlashInfer, torch, Triton, the CUTLASS DSL and tvm-ffi (and
DeepGEMM and b12x when installed), without importing them, for

- environment variables that name a cache, directory or workspace location (the last word of the name
  says so: DIR, ROOT, HOME, BASE, WORKSPACE, CACHE ...): read or set with os.environ.get / getenv /
  environ[...] / "X" in os.environ, any *env*(...) helper (Triton's knobs, the CUTLASS DSL's env_var,
  ...), torch's Config(env_name_force=...), the keys of vLLM's envs.py table, through constants that
  hold the name, and with getenv in the C/C++ sources the libraries JIT-compile;
- default cache paths: a home, XDG or temp-dir expression (".cache", "~/.", Path.home(),
  expanduser("~"), gettempdir()) in code next to the word cache, with no location variable named
  within a few lines (then the file is the key).

Each one must be an env var of a component (warmer.components.ALL) or a key of
warmer.components.NOT_PACKED, the table of what needs no component and why. A library upgrade that
adds a cache fails here instead of on a fleet. Run with -s to see the table.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest

from warmer.components import ALL, NOT_PACKED

REQUIRED = ("vllm", "flashinfer", "torch", "triton", "nvidia_cutlass_dsl", "tvm_ffi")
OPTIONAL = ("deep_gemm", "b12x")  # scanned when installed

# Never imported by a server: test and benchmark code, and FlashInfer's package data (the CUTLASS
# repository it ships as include paths for its JIT, python sources included).
SKIP_DIRS = {"test", "tests", "testing", "benchmarks", "examples", "__pycache__"}
SKIP_PATHS = {"flashinfer/data"}
PYTEST = re.compile(r"^(?:import pytest|from pytest|from _pytest)", re.M)  # test infrastructure

NAME = r"(?:[A-Z]|\{[\w.()]+\})(?:[A-Z0-9_]|\{[\w.()]+\})*"  # FOO_DIR, or f"{prefix}_CACHE_DIR"
STR = r"""[rbuf]{0,2}(["'])(""" + NAME + r")\1"
ARG = r"(?:" + STR + r"|(?:[A-Za-z_]\w*\s*\.\s*)*([A-Za-z_]\w*)\s*[,)\]])"
# Every pattern starts with a literal, so re's fast literal search finds its anchors.
READS = (re.compile(r"environ\s*(?:\.\s*(?:get|setdefault|pop)\s*\(|\[)\s*" + ARG),
         re.compile(r"env\w*\s*\(\s*" + ARG),  # getenv, env_str, get_env_var, env_var, ...
         re.compile(r"env_name_(?:force|default)\s*=\s*\[?\s*" + ARG))
# C and C++ sources the libraries compile at run time (FlashInfer's csrc, JIT headers): getenv, getStrEnv, ...
CXX_EXT = (".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".h", ".hpp", ".hxx", ".inl")
CXX_READ = re.compile(r'(?:getenv|Env\w*)\s*\(\s*"([A-Z][A-Z0-9_]*)"')
IN_ENVIRON = re.compile(r"in\s+(?:os\s*\.\s*)?environ\b")
BEFORE_IN = re.compile(r"(?:" + STR + r"|([A-Za-z_]\w*))\s+(?:not\s+)?$")
ENVS_TABLE = re.compile(r"^[ \t]*([\"'])(" + NAME + r")\1\s*:", re.M)
TEMPLATE = re.compile(r"\{[^{}]*\}")
DSL_PREFIX = re.compile(r"\{(?:[\w.]+\.)?(?:prefix|dsl_name)\}_")  # the CUTLASS DSL's per-DSL names

# A name is a location when its last word says so; a name ending in CACHE is one unless another word
# says it switches a cache, or names one in memory, remote or of the KV pages.
PLACES = {"DIR", "ROOT", "HOME", "BASE", "WORKSPACE", "FOLDER", "LOCATION", "CACHE", "CACHES"}
SWITCHES = {"NO", "DISABLE", "DISABLED", "ENABLE", "ENABLED", "USE", "FORCE", "ALLOW", "REMOTE",
            "MEMORY", "KV"}
BASES = {"HOME", "TMPDIR", "TMP", "TEMP"}  # where defaults start; XDG_* too

DEFAULT_ANCHORS = re.compile(r"\.cache[\"'/]|[\"']~/\.|Path\.home\(\)|expanduser\(\s*[\"']~[\"']\s*\)|gettempdir\(\)")
NEAR = 6  # lines either side of a default path where a location variable explains it


def is_location(name: str) -> bool:
    words = TEMPLATE.sub("X", name).split("_")
    if name in BASES or (len(words) > 1 and words[-2] == "CACHE" and words[-1] in ("PATH", "FILE")):
        return True
    if words[-1] not in PLACES:
        return False
    return not (words[-1].startswith("CACHE") and SWITCHES & set(words))


def is_base(name: str) -> bool:
    return name in BASES or name.startswith("XDG_")


def _resolve(text: str, ident: str) -> str | None:
    """The env var name a module-level or local constant holds (X = "FOO_DIR")."""
    for m in re.finditer(re.escape(ident) + r"\s*(?::[^=\n]{1,40})?=\s*" + STR, text):
        if m.start() == 0 or not (text[m.start() - 1].isalnum() or text[m.start() - 1] in "_."):
            return m.group(2)
    return None


def _fill(text: str, name: str) -> str:
    """{NAME} and {NAME.upper()} in name, filled from a string constant of the module (PACKAGE_NAME = "x")."""
    def value(m: re.Match) -> str:
        c = re.search(r"(?:^|\n)\s*" + re.escape(m.group(1)) + r"\s*(?::[^=\n]{1,40})?=\s*[\"']([\w.-]+)[\"']", text)
        return (c.group(1).upper() if m.group(2) else c.group(1)) if c else m.group(0)
    return re.sub(r"\{(\w+)(\.upper\(\))?\}", value, name)


def env_reads(text: str, rel: str) -> list[tuple[str, int]]:
    """(name, offset) for every env var name text reads or sets."""
    out = []
    for rx in READS:
        for m in rx.finditer(text):
            name = m.group(2) or (m.group(3) and _resolve(text, m.group(3)))
            if not name:
                continue
            # The CUTLASS DSL's EnvVarSpec fields: env_var("CACHE_DIR") is read as {prefix}_CACHE_DIR.
            before = text[m.start() - 1] if m.start() else " "
            if (m.group(2) and text.startswith("env_var", m.start()) and not (before.isalnum() or before == "_")
                    and "_apply_env_var_spec" in text):
                name = "{prefix}_" + name
            out.append((_fill(text, name) if "{" in name else name, m.start()))
    for m in IN_ENVIRON.finditer(text):
        b = BEFORE_IN.search(text, max(0, m.start() - 120), m.start())
        if b:
            name = b.group(2) or _resolve(text, b.group(3))
            if name:
                out.append((name, b.start()))
    if rel == "vllm/envs.py":
        out += [(m.group(2), m.start()) for m in ENVS_TABLE.finditer(text)]
    return out


def default_sites(text: str) -> list[tuple[int, str]]:
    """(line, nearby text) for each default cache path in text: a home/XDG/temp expression in code (not a
    comment or docstring) on a line next to the word cache. A location variable named in the nearby text
    explains it: it is that variable's default."""
    if not any(a in text for a in (".cache", "~/.", "home()", "expanduser", "gettempdir")):
        return []
    lines = text.split("\n")
    out = {}
    for m in DEFAULT_ANCHORS.finditer(text):
        pos = m.start()
        if m.group().startswith(".cache") and (pos == 0 or text[pos - 1] not in "\"'/"):
            continue  # self.cache, module.cache: not a path
        line = text.count("\n", 0, pos)
        if lines[line].lstrip().startswith("#") or (text.count('"""', 0, pos) + text.count("'''", 0, pos)) % 2:
            continue
        if "cache" in "\n".join(lines[max(0, line - 1):line + 2]).lower():
            out[line + 1] = "\n".join(lines[max(0, line - NEAR):line + NEAR + 1])
    return sorted(out.items())


def _dsl_prefixes(roots: dict[str, Path]) -> tuple[str, ...]:
    """The CUTLASS DSL's prefixes (CUTE_DSL, ...), from its env_manager.py, to expand {prefix}_X names."""
    for root in roots.values():
        for p in root.rglob("env_manager.py"):
            text = p.read_text(errors="replace")
            m = re.search(r"CUTLASS_FAMILY_DSL_PREFIXES[^=]*=\s*frozenset\(\s*\{([^}]*)\}", text)
            if m:
                return tuple(re.findall(r"[\"']([A-Z0-9_]+)[\"']", m.group(1)))
    return ()


def _files(roots: dict[str, Path]):
    """(package-relative path, path) of every Python source, and every C/C++ source (FlashInfer's package data
    included: its JIT compiles those)."""
    for pkg, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = pkg + dirpath[len(str(root)):].replace(os.sep, "/")
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            skip_py = any(rel_dir == s or rel_dir.startswith(s + "/") for s in SKIP_PATHS)
            for f in sorted(filenames):
                if (f.endswith(".py") and not skip_py) or f.endswith(CXX_EXT):
                    yield f"{rel_dir}/{f}", os.path.join(dirpath, f)


def census(roots: dict[str, Path]) -> dict[str, list[str]]:
    """Every cache location found under roots (package name -> its directory): an env var name, or the
    file (package-relative) that builds a default cache path no location var explains; each with where."""
    found: dict[str, set[str]] = defaultdict(set)
    sites: list[tuple[str, int, str]] = []
    prefixes = _dsl_prefixes(roots)
    for rel, path in _files(roots):
        if not rel.endswith(".py"):
            with open(path, "rb") as fh:
                data = fh.read()
            if b"getenv" in data or b"Env" in data:
                text = data.decode(errors="replace")
                for m in CXX_READ.finditer(text):
                    if is_location(m.group(1)):
                        found[m.group(1)].add(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}")
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        if "pytest" in text and PYTEST.search(text):
            continue
        if "env" in text:
            for name, pos in env_reads(text, rel):
                if rel.startswith("nvidia_cutlass_dsl/") and prefixes and DSL_PREFIX.match(name):
                    names = [TEMPLATE.sub(p, name, count=1) for p in prefixes]
                else:
                    names = [name]
                for n in names:
                    if is_location(n):
                        found[n].add(f"{rel}:{text.count(chr(10), 0, pos) + 1}")
        sites += [(rel, line, near) for line, near in default_sites(text)]
    # A default path is explained where a location variable (itself censused) is named next to it.
    names = sorted((n for n in found if not is_base(n) and not TEMPLATE.search(n)), key=len, reverse=True)
    explains = re.compile(r"\b(?:" + "|".join(map(re.escape, names)) + r")\b") if names else None
    for rel, line, near in sites:
        if not (explains and explains.search(near)):
            found[rel].add(f"{rel}:{line}")
    return {k: sorted(v, key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1]))) for k, v in found.items()}


def installed() -> dict[str, Path]:
    roots = {}
    for name in REQUIRED + OPTIONAL:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots[name] = Path(list(spec.submodule_search_locations)[0])
    return roots


def component_vars() -> dict[str, str]:
    return {var: c.name for c in ALL for var, _ in c.env}


def uncovered(found: dict[str, list[str]]) -> dict[str, list[str]]:
    covered = component_vars()
    return {k: v for k, v in found.items() if k not in covered and k not in NOT_PACKED}


def _table(found: dict[str, list[str]]) -> str:
    covered = component_vars()
    rows = [f"{k:44} component {c}   ({found[k][0] if k in found else 'not in these sources'})"
            for k, c in sorted(covered.items())]
    rows += [f"{k:44} NOT_PACKED: {NOT_PACKED[k]}" for k in sorted(NOT_PACKED)]
    return "\n".join(rows)


def test_every_cache_the_libraries_write_is_covered_or_listed_with_its_reason():
    roots = installed()
    missing = [n for n in REQUIRED if n not in roots]
    if missing:
        pytest.skip(f"not installed, so not censused: {', '.join(missing)}")
    found = census(roots)
    print(f"\ncache census of {', '.join(sorted(roots))}: {len(found)} locations\n{_table(found)}")

    new = uncovered(found)
    assert not new, (
        "caches that no component points under the root and warmer.components.NOT_PACKED does not list:\n"
        + "\n".join(f"  {k}: {', '.join(v[:3])}" for k, v in sorted(new.items()))
        + "\nread the source there: if vLLM's start-up writes a cache there, add a component "
          "(warmer/components/cute_dsl.py is the model); otherwise add it to NOT_PACKED with the reason.")
    both = sorted(set(NOT_PACKED) & set(component_vars()))
    assert not both, f"NOT_PACKED lists variables a component points under the root: {both}"
    stale = sorted(set(NOT_PACKED) - set(found))
    assert not stale, f"NOT_PACKED lists what the installed libraries no longer have: {stale}"
    # The scan must still see the caches the components exist for, or it has gone blind.
    blind = {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
             "CUTE_DSL_CACHE_DIR", "CUTE_EXPERIMENTAL_DSL_CACHE_DIR", "TVM_FFI_CACHE_DIR",
             "TRTLLM_DG_CACHE_DIR"} - set(found)
    assert not blind, f"the census no longer finds {sorted(blind)}"


def test_a_new_cache_variable_or_default_path_is_reported_as_uncovered(tmp_path):
    lib = tmp_path / "newlib"
    lib.mkdir()
    (lib / "__init__.py").write_text(
        "import os\n"
        "from pathlib import Path\n"
        "CACHE = os.environ.get('NEWLIB_CACHE_DIR', os.path.expanduser('~/.cache/newlib'))\n"
        "OFF = os.environ.get('NEWLIB_DISABLE_CACHE', '0')\n"   # a switch, not a location
        "TRITON = os.environ['TRITON_CACHE_DIR']\n"              # a component's
        "ASSETS = os.getenv('VLLM_ASSETS_CACHE')\n")              # listed in NOT_PACKED
    (lib / "jit.py").write_text(
        "from pathlib import Path\n\n\n"
        "def build_dir():\n"
        "    return Path.home() / '.cache' / 'newlib-kernels'\n")
    (lib / "ws.py").write_text(
        "_KEY = 'NEWLIB_WORKSPACE'\n\n\n"
        "def workspace(environ):\n"
        "    return environ.get(_KEY)\n")
    (lib / "csrc").mkdir()
    (lib / "csrc" / "jit.cuh").write_text('char const* dir = std::getenv("NEWLIB_KERNEL_CACHE_DIR");\n')

    found = census({"newlib": lib})

    assert uncovered(found) == {"NEWLIB_CACHE_DIR": ["newlib/__init__.py:3"],
                                "NEWLIB_KERNEL_CACHE_DIR": ["newlib/csrc/jit.cuh:1"],
                                "NEWLIB_WORKSPACE": ["newlib/ws.py:5"],
                                "newlib/jit.py": ["newlib/jit.py:5"]}
    assert {"TRITON_CACHE_DIR", "VLLM_ASSETS_CACHE"} <= set(found) and "NEWLIB_DISABLE_CACHE" not in found
