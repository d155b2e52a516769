"""file://: `warmer publish` against `cp && sync`, `warmer fetch` against `zstd -d | tar -x`, and a
fetch that finds the artifact already active (the no-op every pod after the first one pays)."""

from __future__ import annotations

from pathlib import Path

from common import measure, pair, rmtree, warmer


def run(ctx, steps: dict, w_art: Path) -> None:
    wd, n = ctx.workdir, ctx.trials
    store = wd / "store"
    rmtree(store)

    def w_pub(i, last):
        r = measure(warmer("publish", str(w_art), "--store", f"file://{store}", "--json"))
        if not last:
            rmtree(store)
        return r

    def b_pub(i, last):
        r = measure(["bash", "-c", 'cp "$0" "$1" && sync "$1"', str(w_art), str(wd / "copy.tar.zst")])
        rmtree(wd / "copy.tar.zst")
        return r

    steps["publish-file"] = pair(n, w_pub, ctx.base(b_pub))
    ctx.say("publish-file")
    blob = next(store.glob("blobs/sha256/*/*.tar.zst"))
    last_root = None

    def w_restore(i, last):
        nonlocal last_root
        last_root = ctx.new_root(f"file-warmer-{i}")
        return ctx.fetch(f"file://{store}", last_root, keep=last)  # the last one: for the no-op fetch

    steps["restore-file"] = pair(
        n, w_restore,
        ctx.base(lambda i, last: ctx.untar(f"zstd -q -d -c {blob} | tar -x -C {{root}}", ctx.new_root(f"file-baseline-{i}"))))
    ctx.say("restore-file")
    steps["noop-fetch"] = pair(n, lambda i, last: ctx.fetch(f"file://{store}", last_root, expect="already-active",
                                                             keep=not last))
    ctx.say("noop-fetch")
    rmtree(store)
