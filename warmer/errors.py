"""One error base for warmer, its kinds, and the exit codes the CLI maps them to.

Every error warmer raises on purpose is a WarmerError whose message is written for the person
running it: what is wrong and what to do. The kind says whose move it is:

    UsageError       the operator's input: flags, a recipe, a key file, a saved fingerprint
    StoreError       the store cannot be used as given (unreachable, denied, missing bucket)
    UntrustedInput   bytes from a store, an artifact or a shared directory were refused

Leaf module: imports nothing from warmer, so every other module may raise these.
"""

from __future__ import annotations

# Exit codes, one table for the CLI, its --help and the README.
EXIT_OK = 0
EXIT_ERROR = 1  # a WarmerError other than a usage error, or an OS error
EXIT_USAGE = 2  # bad arguments, recipe or key file (argparse uses 2 as well)
EXIT_MISS = 3  # fetch --require found no artifact that fits (or could not restore it)
EXIT_NOT_HIT = 4  # verify: the restored start recompiled something
EXIT_FINDINGS = 5  # doctor found an error
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_TERMINATED = 143  # SIGTERM: children (the vLLM engine) were stopped first
EXIT_PIPE = 141  # stdout's reader went away: ended by SIGPIPE (128 + 13), as coreutils are

EXIT_CODES = (
    (EXIT_OK, "success; for fetch also a miss without --require (a slow start, never a failed pod)"),
    (EXIT_ERROR, "an error: the message says what is wrong and what to do"),
    (EXIT_USAGE, "a usage error: bad arguments, recipe, key or fingerprint file"),
    (EXIT_MISS, "fetch --require: no artifact fits this node, or it could not be restored"),
    (EXIT_NOT_HIT, "verify: the restored start recompiled something"),
    (EXIT_FINDINGS, "doctor: an error-level finding"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
    (EXIT_TERMINATED, "terminated (SIGTERM); child processes were stopped"),
    (EXIT_PIPE, "stdout closed early (warmer ls | head -1): ended by SIGPIPE, no message"),
)


class WarmerError(Exception):
    """An error whose message is written for the user: printed as one line, no traceback."""

    kind = "error"
    exit_code = EXIT_ERROR


class UsageError(WarmerError):
    """The operator's input cannot be used: a flag, a recipe, a key or fingerprint file."""

    kind = "usage"
    exit_code = EXIT_USAGE


class StoreError(WarmerError):
    """The store cannot be used as given; the message says how to fix it."""

    kind = "store"


class UntrustedInput(WarmerError):
    """Bytes from outside (a store, an artifact, a file beside the root) were refused."""

    kind = "untrusted-input"


class Terminated(WarmerError):
    """SIGTERM arrived: raised in the main thread so that cleanup (killing children) runs."""

    kind = "terminated"
    exit_code = EXIT_TERMINATED


def exit_code_table() -> str:
    """The table, as --help and the README show it."""
    return "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)
