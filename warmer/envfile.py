"""The env file vLLM starts with: written by fetch and restore, read back by doctor and serve.

Two formats:
    shell   `export KEY='value'`: sourced by sh (`set -a; . FILE; set +a`), any value (a quoted
            newline spans lines, as sh reads it)
    dotenv  KEY=value, or KEY='value' (KEY="value" when it holds a `'`) when the value needs
            quoting: read alike by sh, systemd's EnvironmentFile and docker compose (`docker run
            --env-file` keeps quotes literally). Its readers take it line by line, so a newline,
            or a `'` with one of $ ` " \\ (what sh expands in "..."), is refused: use shell
    docker  KEY=value, the value verbatim: what `docker run --env-file` and `kubectl create
            configmap --from-env-file` read (they keep quotes as part of the value). Never for sh:
            nothing is quoted. A newline, a leading quote or trailing whitespace is refused
Neither carries a control character other than tab and newline (UNSAFE).

A Deployment sources this file, so what goes in is checked like untrusted input: names are
identifiers, values hold no NUL, and a value is quoted whenever it holds anything but plain
characters, so that `$(...)` or a `;` can never run. Leaf module.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import ItemsView, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar, overload

from warmer.errors import UsageError
from warmer.untrusted import InvalidDocument

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
PLAIN = re.compile(r"^[A-Za-z0-9_./:,@%+=-]*\Z")  # nothing sh would expand or split
# What no env value may hold (NUL aside: check_value): control characters but tab and newline,
# and Unicode's line separators. Never part of a real setting, and not carried: serve and doctor
# read the file in Python's text mode, which reads \r as a newline. recipe.py refuses them in [env].
UNSAFE = re.compile(r"[\x01-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
EXPANDED = re.compile(r'[$`"\\]')  # what sh (and compose) reads specially inside "..."
FORMATS = ("dotenv", "shell", "docker")
MAX_BYTES = 1 << 20

_T = TypeVar("_T")


class EnvFileError(InvalidDocument):
    """An env file that cannot be written or read as one."""


def check_name(name: str, where: str = "env") -> str:
    if not NAME.fullmatch(name):  # not match: `$` also matches before a trailing newline
        raise EnvFileError(
            f"{where}: {name!r} is not a valid variable name (letters, digits and '_', not "
            "starting with a digit); it would become a shell command where the file is sourced"
        )
    return name


def check_value(name: str, value: str, where: str = "env") -> str:
    if not isinstance(value, str) or "\0" in value:
        raise EnvFileError(f"{where}: {name} holds a NUL byte or is not a string; refused")
    return value


@dataclass(frozen=True)
class EnvFile:
    """Variables in order; every name and value already checked."""

    vars: dict[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, env: Mapping[str, str], where: str = "env") -> EnvFile:
        return cls({check_name(k, where): check_value(k, v, where) for k, v in env.items()})

    def __iter__(self) -> Iterator[str]:
        return iter(self.vars)

    def items(self) -> ItemsView[str, str]:
        return self.vars.items()

    @overload
    def get(self, name: str) -> str | None: ...
    @overload
    def get(self, name: str, default: _T) -> str | _T: ...
    def get(self, name: str, default: object = None) -> object:
        return self.vars.get(name, default)

    def __getitem__(self, name: str) -> str:
        return self.vars[name]

    def __contains__(self, name: object) -> bool:
        return name in self.vars

    def __len__(self) -> int:
        return len(self.vars)

    def merged(self, other: Mapping[str, str]) -> EnvFile:
        return EnvFile.of({**self.vars, **dict(other)})

    def render(self, fmt: str) -> str:
        if fmt not in FORMATS:
            raise UsageError(f"env format {fmt!r}: use one of {', '.join(FORMATS)}")
        lines = []
        for k, v in self.vars.items():
            if bad := UNSAFE.search(v):
                raise EnvFileError(
                    f"env {k} holds U+{ord(bad.group()):04X}, a control character or line separator, which an "
                    "env file cannot carry (only text, tabs and newlines): remove it"
                )
            try:
                v.encode()
            except UnicodeEncodeError:
                raise EnvFileError(
                    f"env {k} is not UTF-8 text (a path named in other bytes?), which an env file must be: rename it"
                ) from None
            if fmt == "shell":
                lines.append(f"export {k}={shlex.quote(v)}")
            elif fmt == "docker":  # its readers keep every byte after the `=`
                if "\n" in v or v[:1] in ("'", '"') or v != v.rstrip():
                    raise EnvFileError(
                        f"env {k} holds a newline, a leading quote or trailing whitespace, which "
                        "`docker run --env-file` and `kubectl create configmap --from-env-file` read differently "
                        "from warmer and no quoting fixes: change the value, or write --env-format shell and "
                        "source that file in the container's command"
                    )
                lines.append(f"{k}={v}")
            elif PLAIN.fullmatch(v):
                lines.append(f"{k}={v}")
            elif "\n" in v or ("'" in v and EXPANDED.search(v)):  # readers take a dotenv file line by line
                why = "a newline" if "\n" in v else "a ' and one of $ ` \" \\"
                raise EnvFileError(
                    f"env {k} holds {why}, which a dotenv file cannot carry safely: use --env-format shell"
                )
            elif "'" in v:
                lines.append(f'{k}="{v}"')
            else:
                lines.append(f"{k}='{v}'")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, where: str = "env file") -> EnvFile:
        """Either format, as written above; comments and blank lines are skipped."""
        if len(text) > MAX_BYTES:
            raise EnvFileError(f"{where} is over {MAX_BYTES} bytes: not an env file warmer wrote")
        env: dict[str, str] = {}
        lines = text.split("\n")  # as sh splits them (str.splitlines also splits at \v, \x1c, \u2028...)
        n = 0
        while n < len(lines):
            line = lines[n].lstrip()
            n += 1
            at = f"{where}:{n}"
            if not line.strip() or line.startswith("#"):
                continue
            if line.startswith("export "):
                body = line[len("export ") :]
            else:  # dotenv: a quoted value as sh reads it, an unquoted one literally (as docker does)
                k, eq, v = line.strip().partition("=")
                if v[:1] not in ("'", '"'):
                    if not eq:
                        raise EnvFileError(f"{at}: {line.strip()[:60]!r} is not KEY=VALUE")
                    env[check_name(k.strip(), at)] = check_value(k, v, at)
                    continue
                body = line
            parts, quote = [body], _open_quote(body)
            while quote and n < len(lines):  # a quoted newline (shell format): the value goes on
                parts.append(lines[n])
                quote = _open_quote(lines[n], quote)
                n += 1
            body = "\n".join(parts)
            try:
                tokens = shlex.split(body, posix=True)
            except ValueError as e:
                raise EnvFileError(
                    f"{at}: {e} (an unterminated quote?): fix or regenerate the file with `warmer fetch --env-file`"
                ) from None
            for token in tokens:
                k, eq, v = token.partition("=")
                if not eq:
                    raise EnvFileError(f"{at}: {token!r} is not KEY=VALUE")
                env[check_name(k, at)] = check_value(k, v, at)
        return cls(env)


def _open_quote(text: str, quote: str = "") -> str:
    """The quote still open at the end of text, as sh (and shlex) reads it, given the one open at
    its start: linear, so that an unterminated quote cannot make parse() quadratic."""
    escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif quote == "'":
            quote = "" if c == "'" else quote
        elif c == "\\":
            escaped = True
        elif c == quote:
            quote = ""
        elif not quote and c in "'\"":
            quote = c
    return quote
