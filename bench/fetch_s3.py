"""s3://: `warmer publish` against `aws s3 cp` up, `warmer fetch` against `aws s3 cp` down + `tar
--zstd -x`, on s3rver (a Node S3 API server that serves ranged GETs at loopback speed; moto, the
tests' server, is Python and slow on them, so a download there measures moto).

Unthrottled (loopback: the CPU decides), and through the fault proxy (tests/integration/faultproxy.py)
throttled to each of RATES: there the floor is the blob's bytes over the rate, and the rows say how
close to it each side comes.
"""

from __future__ import annotations

from pathlib import Path

from common import BUCKET, aws_env, measure, pair, s3rver, throttled, warmer

RATES = (100e6, 1e9)  # bytes per second: a 0.8 Gb/s link and an 8 Gb/s one


def run(ctx, steps: dict, w_art: Path, aws: str, rates=RATES) -> None:
    wd, n = ctx.workdir, ctx.trials
    with s3rver(wd) as endpoint:
        env = aws_env(wd, endpoint)

        def w_pub(i, last):
            return measure(warmer("publish", str(w_art), "--store", f"s3://{BUCKET}/w{i}", "--json"), env=env)

        def b_pub(i, last):
            return measure([aws, "s3", "cp", "--only-show-errors", str(w_art), f"s3://{BUCKET}/b{i}/a.tar.zst"],
                           env=env)

        steps["publish-s3"] = pair(n, w_pub, ctx.base(b_pub))
        ctx.say("publish-s3")
        local = wd / "download.tar.zst"

        def rows(label: str, env_: dict):
            return pair(n, lambda i, last: ctx.fetch(f"s3://{BUCKET}/w0", ctx.new_root(f"{label}-warmer-{i}"), env=env_),
                        ctx.base(lambda i, last: ctx.untar(
                            f"{aws} s3 cp --only-show-errors s3://{BUCKET}/b0/a.tar.zst {local} "
                            f"&& tar --zstd -xf {local} -C {{root}} && rm {local}",
                            ctx.new_root(f"{label}-baseline-{i}"), env=env_)))

        steps["restore-s3"] = rows("s3", env)
        ctx.say("restore-s3")
        for rate in rates:
            name = f"restore-s3-{int(rate / 1e6)}MBps"
            with throttled(endpoint, rate, wd) as proxy:
                steps[name] = rows(name, aws_env(wd, proxy))
            steps[name]["rate"] = rate
            steps[name]["floor_s"] = w_art.stat().st_size / rate
            ctx.say(name)
