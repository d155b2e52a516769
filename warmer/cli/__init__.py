"""Command line: parses arguments, runs one command, maps its errors to exit codes.

The commands are this package's modules, found here, not listed: warmer/cli/NAME.py for `warmer
NAME` (a "-" in the command is a "_" in the module), each with HELP, ORDER (its place in `warmer
--help`), add_arguments(parser), run(args, out) -> int and the rendering of its result. A new
command is such a module, its function in warmer.api and its test. Only the module of the command
given is imported: `warmer fetch` loads no other command's.

Errors are mapped to exit codes in one place (main) by their kind (warmer.errors); with --json
an error is also a JSON object on stdout, so a pipeline reads one stream.
"""

from __future__ import annotations

import argparse
import difflib
import gc as _gc  # not `gc`: the command module warmer.cli.gc becomes this package's attribute gc
import importlib
import json
import logging
import os
import pkgutil
import re
import select
import signal
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

# Commands call warmer.api alone; warmer.errors is the error model every module shares.
from warmer import __version__, api, errors
from warmer.atomic import in_place, own_stream
from warmer.envfile import FORMATS

if TYPE_CHECKING:
    from warmer.api import EnvFile


@dataclass(frozen=True)
class Output:
    """Where a command's words go: its result on stdout (JSON with --json), what it says along the
    way on stderr, and with --quiet nothing there but errors."""

    json: bool = False
    quiet: bool = False

    @property
    def progress(self) -> bool:
        """Transfer bars: only for a person at a terminal, never in pipelines or with --json."""
        return sys.stderr.isatty() and not self.json and not self.quiet

    def emit(self, result: Any, human: str | None = None) -> None:
        """The result on stdout: JSON with --json, else human (None: nothing without --json)."""
        if self.json:
            print(json.dumps(result.to_json() if hasattr(result, "to_json") else result, indent=1, default=str))
        elif human is not None:
            print(human)

    def say(self, text: str) -> None:
        if not self.quiet:
            to_stderr(text)

    def warn(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.say(f"warmer: warning: {line}")


def to_stderr(text: str) -> None:
    """A line on stderr, at best: a reader of stderr gone (a log pipe that died) or a full disk
    must not stop a command whose work is done, a fetch whose env file is still to be written."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def store_options(args: argparse.Namespace, out: Output) -> dict:
    return {
        "endpoint_url": getattr(args, "endpoint_url", None),
        "path_style": getattr(args, "s3_path_style", None) or None,
        "insecure_registry": getattr(args, "insecure_registry", None) or None,
        "progress": out.progress,
    }


def check_out_file(flag: str, path: str, fix: str) -> None:
    """A file a command writes once its work is done (an env file, metrics), checked before the work:
    a directory this user cannot write is the operator's to fix (exit 2), said before anything is
    fetched; found after, it fails the pod that the fetch had just warmed."""
    where = os.path.dirname(os.path.abspath(path))
    if in_place(Path(path)) and (own_stream(Path(path)) or os.access(path, os.W_OK, effective_ids=True)):
        return  # /dev/stdout, /dev/null: written into
    if os.path.isdir(path):
        raise errors.UsageError(f"{flag} {path} is a directory: name a file (in it, say)")
    # as the write will be judged: effective ids and capabilities
    if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK, effective_ids=True):
        raise errors.UsageError(f"{flag} {path}: {where} is not a directory this user can write: {fix}")


def write_env(args: argparse.Namespace, env: EnvFile) -> None:
    """The env of add_env_out's flags: to --env-file, or as shell lines on stdout (not with --json)."""
    if args.env_file:
        api.write_env(env, args.env_file, args.env_format)
    elif not args.json:
        sys.stdout.write(env.render("shell"))


# -- Options several commands share ------------------------------------------------------------

QUIET_HELP = "print errors only on stderr (no warnings, no progress)"


def env_value(name: str) -> str | None:
    """A variable's value without the whitespace around it (a value read from a mounted Secret or
    ConfigMap file ends in a newline), or None when unset or blank (an empty ConfigMap key)."""
    return os.environ.get(name, "").strip() or None


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def env_now(name: str) -> str:
    """The ", now VALUE" of a flag's help when the env sets its default (README: --help shows each)."""
    value = os.environ.get(name)
    return f", now {value}".replace("%", "%%") if value else ""  # argparse %-formats help texts


def add_recipe(c: argparse.ArgumentParser) -> None:
    c.add_argument("recipe", metavar="RECIPE", help="a recipe file, e.g. manifests/models/NAME.toml")


# --store and --root are never required=True in argparse: the env can give them, and argparse's
# usage line cannot say "this flag or that variable". main() refuses a command that has neither.
def add_store(c: argparse.ArgumentParser, required: bool = True) -> None:
    default = env_value("WARMER_STORE")
    c.add_argument(
        "--store",
        default=default,
        metavar="URL",
        help="where artifacts live: file:///abs/dir, s3://bucket/prefix or oci://registry/repository "
        f"({'required: this or ' if required else ''}env WARMER_STORE"
        f"{env_now('WARMER_STORE')})",
    )
    c.set_defaults(needs_store=required)
    add_s3(c)


def add_root(
    c: argparse.ArgumentParser,
    required: bool = True,
    what: str = "the directory vLLM's caches live under (the build's root path)",
) -> None:
    default = env_value("WARMER_ROOT")
    c.add_argument(
        "--root",
        default=default,
        help=f"{what} ({'required: this or ' if required else ''}env WARMER_ROOT{env_now('WARMER_ROOT')})",
    )
    c.set_defaults(needs_root=required)


def add_s3(c: argparse.ArgumentParser) -> None:
    c.add_argument("--endpoint-url", help="S3-compatible endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
    c.add_argument(
        "--s3-path-style",
        action="store_true",
        help="path-style S3 addressing (endpoint/bucket/key), as many S3-compatible stores need",
    )
    c.add_argument(
        "--insecure-registry", action="store_true", help="plain HTTP to an oci:// registry that is not on loopback"
    )


def add_env_out(c: argparse.ArgumentParser) -> None:
    """The flags write_env reads."""
    c.add_argument("--env-file", help="write the env vLLM must start with to this file")
    c.add_argument(
        "--env-format",
        choices=FORMATS,
        default="dotenv",
        help="format of --env-file: dotenv (default; KEY=VALUE, quoted where needed, for sh, systemd "
        "and docker compose), shell (export lines, any value) or docker (KEY=VALUE verbatim, for "
        "`docker run --env-file` and `kubectl create configmap --from-env-file`)",
    )
    c.add_argument(
        "--offline",
        action="store_true",
        help="nodes without network: forbid FlashInfer downloads (FLASHINFER_NO_DOWNLOAD=1); a "
        "kernel the warm-up never fetched is then an error at serve time",
    )


def add_sign_key(c: argparse.ArgumentParser) -> None:
    c.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the artifact with")


def add_layers(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--layers",
        action="store_true",
        default=env_flag("WARMER_LAYERS"),
        help="publish each cache component as a layer of its own, stored once whatever number of "
        "artifacts hold it (only the layers the store lacks go up); nodes need this warmer version "
        f"to read it (env WARMER_LAYERS=1{env_now('WARMER_LAYERS')})",
    )


class _AppendOverEnv(argparse.Action):
    """append, where the first flag replaces a default the env gave: a flag wins, as for every
    setting (argparse's own append adds to the default, so a key rotated out of the env stays trusted)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        given = getattr(namespace, self.dest)
        keep = [] if given is self.default else list(given or [])
        setattr(namespace, self.dest, [*keep, values])


def add_trust(c: argparse.ArgumentParser, what: str = "only artifacts it signed are restored") -> None:
    default = [k.strip() for k in (env_value("WARMER_TRUSTED_KEY") or "").split(os.pathsep) if k.strip()] or None
    c.add_argument(
        "--trusted-key",
        action=_AppendOverEnv,
        metavar="PUBKEY",
        default=default,
        help=f"Ed25519 public key (PEM); when given, {what} "
        f"(repeat for several keys; env WARMER_TRUSTED_KEY, several separated by ':'{env_now('WARMER_TRUSTED_KEY')})",
    )


def add_deadline(c: argparse.ArgumentParser, default: float | None, what: str) -> None:
    env = env_value(api.DEADLINE_ENV)
    # A string default goes through type= as a flag would: a bad value is a usage error, not a traceback.
    c.add_argument(
        "--deadline",
        type=_seconds,
        default=env or default,
        metavar="SECONDS",
        help=f"give up on the store after this long: {what} (env {api.DEADLINE_ENV}; default "
        f"{'none' if default is None else f'{default:.0f}'}{env_now(api.DEADLINE_ENV)})",
    )


def add_owner(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--owner",
        type=_owner,
        default=env_value("WARMER_OWNER"),
        metavar="UID:GID",
        help="hand the restored root to this user (run as root): vLLM, which writes lock and "
        f"temporary files into it even on a full hit, runs as UID (env WARMER_OWNER{env_now('WARMER_OWNER')})",
    )


def add_limits(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--max-bytes",
        type=size,
        default=api.DEFAULT_MAX_BYTES,
        metavar="SIZE",
        help="refuse artifacts that unpack to more than this: bytes, or with a unit, e.g. 256GiB, "
        f"512MiB, 10GB (default {api.DEFAULT_MAX_BYTES >> 30} GiB)",
    )
    c.add_argument(
        "--lock-timeout",
        type=float,
        default=api.DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="wait at most this long for another restore of the same root (default 900)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]i?B)?\s*", re.I)


def size(text: str) -> int:
    """Bytes, from a plain count or a number with a unit: 256GiB (2^30), 10GB (10^9), 512MiB, 64kB."""
    m = _SIZE.fullmatch(text)
    if m:
        number, unit = m[1], (m[2] or "B").upper()
        scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** " KMGT".index(unit[0])
        if (unit != "B" or number.isdigit()) and float(number) * scale >= 1:  # no fractions of a byte
            return int(float(number) * scale)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a size: give bytes (e.g. 274877906944) or a number and a "
        "unit, e.g. 256GiB, 512MiB, 10GB (GB is 10^9 bytes, GiB 2^30)"
    )


def _owner(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not uid.isdigit() or (sep and not gid.isdigit()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not UID or UID:GID in numbers (e.g. 1000:1000, as the "
            "serving container's runAsUser and runAsGroup)"
        )
    return int(uid), int(gid) if sep else int(uid)


# -- The parser --------------------------------------------------------------------------------

EPILOG = (
    "environment: WARMER_STORE, WARMER_ROOT, WARMER_TRUSTED_KEY, WARMER_REQUIRE, WARMER_DEADLINE,\n"
    "WARMER_OWNER and WARMER_LAYERS are the defaults of --store, --root, --trusted-key, --require,\n"
    "--deadline, --owner and --layers; a flag wins.\n\nexit codes:\n" + errors.exit_code_table()
)
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)$")
_COMMAND = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


class Parser(argparse.ArgumentParser):
    """argparse, its usage errors as warmer's others: a "did you mean" for a mistyped command or
    choice, and with --json (json_errors) the JSON error object on stdout as well (exit 2 either way)."""

    json_errors = False
    partial = False  # holds one command only (parser(only=...))

    def error(self, message: str) -> NoReturn:
        if self.partial:  # its usage line would name one command: the whole parser's says it
            parser(json_errors=self.json_errors).error(message)
        m = _INVALID_CHOICE.search(message)
        if m:
            close = difflib.get_close_matches(m["value"], re.findall(r"'([^']*)'", m["choices"]), n=1)
            if message.startswith("argument command:"):  # not argparse's list of all sixteen
                message = f"unknown command {m['value']!r}" + ("" if close else " (`warmer --help` lists them)")
            if close:
                message += f"; did you mean {close[0]}?"
        if self.json_errors:
            print(json.dumps({"error": message, "kind": "usage", "exit_code": errors.EXIT_USAGE}), flush=True)
        super().error(message)


def command(module_name: str) -> ModuleType | None:
    """The command module of that name, or None: no such module, or one that is not a command
    (render, the reports' shared helpers)."""
    if module_name.startswith("_"):
        return None
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{module_name}":
            raise
        return None
    return module if hasattr(module, "run") and hasattr(module, "add_arguments") else None


def commands() -> list[ModuleType]:
    """Every command module of this package, in the order of `warmer --help`."""
    names = [m.name for m in pkgutil.iter_modules(__path__)]
    # Importing warmer.cli.NAME sets this package's NAME: whatever this module has by that name is lost.
    clash = [n for n in names if n in globals() and globals()[n] is not sys.modules.get(f"{__name__}.{n}")]
    if clash:
        raise RuntimeError(f"warmer/cli/{clash[0]}.py would replace warmer.cli.{clash[0]}: rename one of them")
    found = [command(name) for name in names]
    return sorted((m for m in found if m is not None), key=lambda m: m.ORDER)


def name_of(module: ModuleType) -> str:
    return module.__name__.rpartition(".")[2].replace("_", "-")


def parser(json_errors: bool = False, only: ModuleType | None = None) -> Parser:
    """warmer's parser: every command, or only that one (no other command module is imported)."""
    p = Parser(
        prog="warmer",
        description="Warm vLLM's compile caches once per GPU type; start every later node warm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.json_errors, p.partial = json_errors, only is not None
    p.add_argument("--version", action="version", version=f"warmer {__version__}")
    p.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    for module in [only] if only else commands():
        c = sub.add_parser(
            name_of(module),
            help=module.HELP,
            description=module.HELP,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.json_errors = json_errors
        c.set_defaults(run=module.run)
        c.add_argument("--json", action="store_true", help="print JSON for machines (errors too, on stdout)")
        # After the command too (warmer fetch ... -q); SUPPRESS: absent here, the top level's value stands.
        c.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET_HELP)
        module.add_arguments(c)
    return p


def _given(argv: list[str]) -> ModuleType | None:
    """The module of the command argv names, when nothing but -q comes before it: then no other is
    imported. Anything else (--help, a typo) gets the whole parser."""
    for token in argv:
        if token not in ("-q", "--quiet"):
            return command(token.replace("-", "_")) if _COMMAND.fullmatch(token) else None
    return None


def _log_to_stderr(quiet: bool, json: bool = False) -> None:
    """Progress and retry lines (the "warmer" logger) on stderr: with json its warnings alone, and
    quiet (errors only) not even those."""
    logger = logging.getLogger("warmer")
    if not any(getattr(h, "warmer_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("warmer: %(message)s"))
        handler.warmer_cli = True  # type: ignore[attr-defined]  # marks ours: main runs again in tests
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.ERROR if quiet else logging.WARNING if json else logging.INFO)


def _terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise errors.Terminated("terminated by SIGTERM")


def _stdout_gone() -> bool:
    """Whether stdout is a pipe its reader has closed (poll says POLLERR): a BrokenPipeError from a
    store's socket is an error like any other, one from stdout is not."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _needs(args: argparse.Namespace) -> None:
    """--store and --root where a command needs them: the flag, or the env var (see add_store)."""
    for flag, env, what in (
        ("store", "WARMER_STORE", "URL: file:///abs/dir, s3://bucket/prefix or oci://registry/repository"),
        ("root", "WARMER_ROOT", "DIR"),
    ):
        if getattr(args, f"needs_{flag}", False) and not getattr(args, flag, None):
            raise errors.UsageError(f"--{flag} is required here: give --{flag} {what}, or set {env} in the environment")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("stdout", "stderr"):  # started with the fd closed (`2>&-`): Python left None there
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # for the process's life
    # Everything after a lone -- goes to vLLM as it is (warmer serve R --root D -- --port 8000).
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    json_errors = "--json" in ours  # argparse's own usage errors are JSON on stdout too
    args = parser(json_errors, only=_given(ours)).parse_args(ours)
    if extra and args.command != "serve":
        parser(json_errors).error(f"`-- {' '.join(extra)}`: only `warmer serve` passes flags on (to vLLM)")
    args.extra = extra
    out = Output(json=getattr(args, "json", False), quiet=args.quiet)
    _log_to_stderr(args.quiet, out.json)
    # SIGTERM becomes an exception in the main thread, so that what a command started (the vLLM
    # engine's process group, a staging directory) is cleaned up on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        _needs(args)
        return args.run(args, out)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", "interrupted", errors.EXIT_INTERRUPTED)
    except errors.WarmerError as e:  # report: what a failed command measured up to then (build's BuildError)
        return _fail(args, str(e), e.kind, e.exit_code, getattr(e, "report", None))
    except OSError as e:  # a file the operator named, a disk: the message says which
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            raise  # whoever read stdout went away (`warmer ls | head -1`): run() ends quietly
        return _fail(
            args, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""), "os-error", errors.EXIT_ERROR
        )
    except Exception as e:  # a bug in warmer: its traceback, and with --json still one JSON document
        if not out.json:
            raise
        traceback.print_exc()
        return _fail(args, f"unexpected {type(e).__name__}: {e} (a bug in warmer)", "internal", errors.EXIT_ERROR)


def run() -> None:
    """The `warmer` command (and `python -m warmer`): main, then exit without the garbage
    collector's last pass over every object the imports made (0.08 s of a node's fetch)."""
    code: int | str | None
    try:
        try:
            code = main()
        except SystemExit as e:  # argparse's --help, --version and usage errors
            code = e.code
        sys.stdout.flush()  # here, not at exit: a reader gone is then seen below, not as a traceback
    except BrokenPipeError:  # only stdout's gets here (main)
        _exit_on_sigpipe()
    _gc.freeze()
    sys.exit(code)


def _exit_on_sigpipe() -> NoReturn:
    """End as coreutils do when their reader goes (`warmer ls | head -1`): killed by SIGPIPE, no
    message, no traceback; the shell says 141 (128 + 13), which pipefail scripts and the
    `|| [ $? -eq 141 ]` idiom already know from `ls | head`. Not exit 1: that is "an error, the
    message says what", and nothing went wrong here. Python ignores SIGPIPE so that a broken
    socket (a store's) is an exception; the default comes back only now, to end this process."""
    try:  # nothing more may reach the pipe, not even the interpreter's flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(errors.EXIT_PIPE)  # not reached: the signal ends the process


def _fail(args: argparse.Namespace, message: str, kind: str, code: int, report: Any = None) -> int:
    to_stderr(f"warmer: {args.command}: {message}")
    if getattr(args, "json", False):
        doc: dict[str, Any] = {"error": message, "kind": kind, "exit_code": code}
        if hasattr(report, "to_json"):  # inside the one object: stdout stays one JSON document
            doc["report"] = report.to_json()
        print(json.dumps(doc, default=str))
    return code
