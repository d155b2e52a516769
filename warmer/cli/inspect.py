"""warmer inspect: what an artifact file or a published artifact is, holds, and was built on."""

from __future__ import annotations

import argparse

from warmer import api
from warmer.cli import Output, add_s3, store_options
from warmer.cli.render import megabytes, shown
from warmer.errors import EXIT_OK

HELP = "show the artifact.json of an artifact file or of a published artifact"
ORDER = 100


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "file",
        metavar="FILE|URL",
        help="an artifact file, or STORE/index/RECIPE/KEY (a key prefix of 8+ hex digits will do)",
    )
    c.add_argument("--full", action="store_true", help="with --json: the whole artifact.json, file list included")
    add_s3(c)


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.inspect(args.file, **store_options(args, out))
    out.emit(result.artifact.to_json() if args.full else result.summary(), report(result))
    return EXIT_OK


def report(i: api.Inspection) -> str:
    """An artifact for a person: what it is, what it holds, where it was built; --json has the rest."""
    a = i.artifact
    model = a.recipe.identity.get("model") if isinstance(a.recipe.identity, dict) else None
    lines = [
        f"key:        {a.key}",
        f"recipe:     {a.recipe.name} (digest {a.recipe.digest[:16]}{', model ' + str(model) if model else ''})",
        f"created:    {a.created_at or '-'} by warmer {a.warmer}",
        f"built on:   {a.fingerprint.describe()}",
        f"built at:   root {a.path_contract.root}, model {a.path_contract.model}",
        "components:",
    ]
    lines += [f"  {name:<22}{c.files:>7} files {megabytes(c.bytes):>12}" for name, c in a.components.items()]
    lines.append(f"  {'total':<22}{len(a.files):>7} files {megabytes(a.total_bytes):>12}")
    v = a.timings.get("verify") or {}
    if v:
        lines.append(f"verified:   {v.get('verdict', '-')}, {shown(v.get('recompiled_files'))} recompiled file(s)")
    if a.vllm:
        lines.append(f"vLLM:       {a.vllm.version or '-'}, config hash {shown(a.vllm.config_hash)}")
    if a.serve_env:
        lines.append("serve env:  " + ", ".join(f"{k}={v}" for k, v in a.serve_env.items()))
    signature = i.entry.signature if i.entry else i.signature
    lines.append(
        f"signed:     yes, by key {signature.key_id}"
        if signature
        else "signed:     no" + ("" if i.entry else " (no .sig file beside it)")
    )
    if i.entry and i.entry.blob is not None:
        lines.append(
            f"blob:       {i.entry.blob.sha256} ({megabytes(i.entry.blob.size)}), published "
            f"{i.entry.published_at.isoformat()}"
        )
    elif i.entry:  # a layered entry: a blob per cache component, each stored once
        total = sum(b.size for b in i.entry.blobs)
        lines.append(
            f"layers:     {len(i.entry.artifact.layers)} blob(s), {megabytes(total)}, published "
            f"{i.entry.published_at.isoformat()}"
        )
        lines += [f"  {x.component:<22}{x.sha256[:12]:>13} {megabytes(x.size):>12}" for x in i.entry.artifact.layers]
    lines.append("more: --json (timings, path contract, vLLM's key), --json --full (artifact.json whole)")
    return "\n".join(lines)
