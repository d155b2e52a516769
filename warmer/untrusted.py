"""Reading JSON that came from outside: a size cap, a depth cap, and typed fields with one error.

Every document warmer reads from a store or a shared directory (index entries, artifact.json,
markers, saved fingerprints) goes through load_json() and a Fields reader once, at the
boundary, into a frozen type; code past the boundary never sees the raw JSON. Anything that
is not what the type expects raises InvalidDocument with the field's path, never a KeyError or
a TypeError deep inside. Leaf module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any, Literal, overload

from warmer.errors import UntrustedInput

# Deeper than any document warmer writes (a fingerprint nests 4 levels, a recipe identity a few
# more); json's C decoder would otherwise recurse until Python's limit and raise RecursionError.
MAX_DEPTH = 64
MAX_INT = 2**63 - 1  # what fits an os.stat field or a file size


class InvalidDocument(UntrustedInput):
    """A JSON document that is not what its type expects; the message names the field."""


def load_json(data: bytes | str, *, what: str, max_bytes: int) -> Any:
    """Parse data as JSON, refusing more than max_bytes, invalid UTF-8 or JSON, and deep nesting."""
    if len(data) > max_bytes:
        raise InvalidDocument(f"{what} is {len(data)} bytes, over the limit of {max_bytes}: refused")
    try:
        doc = json.loads(data)
    except RecursionError:
        raise InvalidDocument(f"{what} nests too deeply to be a warmer document: refused") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidDocument(f"{what} is not valid JSON ({e})") from None
    _check_depth(doc, what)
    return doc


def _check_depth(doc: Any, what: str) -> None:
    stack: list[tuple[Any, int]] = [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidDocument(f"{what} nests deeper than {MAX_DEPTH} levels: refused")
        # A plain loop: a generator per container cost 0.03 s for an artifact of 11,000 files.
        for v in value.values() if isinstance(value, dict) else value:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


class Fields:
    """Typed access to one JSON object; every failure names the field's path in the document.

    Accessors are named for the JSON kind they want (text, integer, flag, array), not for the
    builtins: a method named str or int would shadow the builtin in every annotation below it.
    """

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise InvalidDocument(f"{where} must be an object, got {_kind(doc)}")
        self.doc: dict[str, Any] = doc
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}"

    def _fail(self, key: str, want: str) -> InvalidDocument:
        value = self.doc.get(key, _MISSING)
        got = "nothing (missing)" if value is _MISSING else _kind(value)
        return InvalidDocument(f"{self._path(key)} must be {want}, got {got}")

    def has(self, key: str) -> bool:
        return key in self.doc

    def raw(self, key: str, default: Any = None) -> Any:
        """A value of any JSON type (opaque data, e.g. a recipe's engine args)."""
        return self.doc.get(key, default)

    def obj(self, key: str) -> Fields:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, dict):
            raise self._fail(key, "an object")
        return Fields(value, self._path(key))

    def opt_obj(self, key: str) -> Fields | None:
        return None if self.doc.get(key) is None else self.obj(key)

    def text(self, key: str, *, max_len: int = 1 << 16) -> str:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, str):
            raise self._fail(key, "a string")
        if len(value) > max_len or "\0" in value:
            raise InvalidDocument(f"{self._path(key)} is longer than {max_len} characters or holds a NUL: refused")
        return value

    def opt_text(self, key: str, *, max_len: int = 1 << 16) -> str | None:
        return None if self.doc.get(key) is None else self.text(key, max_len=max_len)

    def integer(self, key: str, *, low: int = -MAX_INT, high: int = MAX_INT) -> int:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, "an integer")
        if not low <= value <= high:
            raise InvalidDocument(f"{self._path(key)} is {value}, outside {low}..{high}: refused")
        return value

    def opt_integer(self, key: str, *, low: int = -MAX_INT, high: int = MAX_INT) -> int | None:
        return None if self.doc.get(key) is None else self.integer(key, low=low, high=high)

    def number(self, key: str) -> float:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise self._fail(key, "a finite number")
        return value

    def flag(self, key: str) -> bool:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def array(self, key: str) -> list[Any]:
        value = self.doc.get(key, _MISSING)
        if not isinstance(value, list):
            raise self._fail(key, "a list")
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        value = self.array(key)
        if not all(isinstance(v, str) for v in value):
            raise InvalidDocument(f"{self._path(key)} must be a list of strings")
        return tuple(value)

    @overload
    def str_map(self, key: str, *, values_may_be_null: Literal[False] = ...) -> dict[str, str]: ...
    @overload
    def str_map(self, key: str, *, values_may_be_null: bool) -> dict[str, str | None]: ...
    def str_map(self, key: str, *, values_may_be_null: bool = False) -> dict[str, str] | dict[str, str | None]:
        fields = self.obj(key)
        for k, v in fields.doc.items():
            if not (isinstance(v, str) or (values_may_be_null and v is None)):
                raise InvalidDocument(f"{fields._path(k)} must be a string, got {_kind(v)}")
        return dict(fields.doc)

    def items(self, key: str) -> Iterable[tuple[str, Fields]]:
        """The entries of an object whose values are objects."""
        fields = self.obj(key)
        return [(k, fields.obj(k)) for k in fields.doc]

    def objs(self, key: str) -> list[Fields]:
        """The entries of a list of objects."""
        return [Fields(v, f"{self._path(key)}[{i}]") for i, v in enumerate(self.array(key))]


_MISSING = object()
