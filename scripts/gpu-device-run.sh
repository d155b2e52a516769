#!/usr/bin/env bash
# One call of a lent GPU machine (issue 28; README "The GPU check"). It runs the GPU check, then
# each check's negative control, which reuses the cold runs and warm restarts the check left. All
# logs and reports go into one file, $OUT/gpu-run.tar.gz: the device returns at most 8 files, none
# deeper than 2 folders. Exit 0 only when the check passed and every negative control failed as it
# must.
#
#   make gpu-wheels                                      here, before: the wheels the device lacks
#   OUT=... bash scripts/gpu-device-run.sh [--quick]     there, carrying .whl
#   bash scripts/gpu-device-run.sh --cpu                 the same here, on the CPU
#
# Checks that cannot run on a CPU (the autotuners) have no negative control with --cpu.
# The tool that runs it kills a command at 600 s, and whatever it had not yet packed with it: so the
# logs are packed after each step, and each step gets only what is left of WARMER_DEVICE_BUDGET_S
# (default 560 s); a negative control it cannot fit is said, not run, and one the budget stops is
# said so: the run is then INCOMPLETE, not FAIL.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:=$(mktemp -d)}"
LOGS=$(mktemp -d)
BUDGET=${WARMER_DEVICE_BUDGET_S:-560}
NEGATIVE_S=${WARMER_DEVICE_NEGATIVE_S:-45}  # the least a negative control needs (about 15-30 s measured on CPU)
save() { tar -czf "$OUT/gpu-run.tar.gz.part" -C "$LOGS" . && mv "$OUT/gpu-run.tar.gz.part" "$OUT/gpu-run.tar.gz"; }
export WARMER_GPU_CHECK_DIR=${WARMER_GPU_CHECK_DIR:-${TMPDIR:-/tmp}/warmer-gpu-check}
# gpu_check.py copies each process's logs beside its report when it ends; one stopped by the budget
# or crashed did not: then they are taken from the work dir here (before the next step replaces them),
# with pip's log of the wheels' install.
keep() {
  local dest=$LOGS/$1 runs=$WARMER_GPU_CHECK_DIR/runs f
  if [ -f "$WARMER_GPU_CHECK_DIR/pip.log" ] && [ ! -f "$LOGS/pip.log" ]; then cp "$WARMER_GPU_CHECK_DIR/pip.log" "$LOGS/"; fi
  [ -f "$dest/gpu-check.json" ] && return 0
  for f in "$runs"/*/*/output.log "$runs"/*/*/result.json "$runs"/*/*/log/*.log; do
    [ -f "$f" ] || continue
    mkdir -p "$(dirname "$dest/gpu-check-logs/${f#"$runs"/}")" && cp "$f" "$dest/gpu-check-logs/${f#"$runs"/}"
  done
}
NEGATIVES=(torch-compile aot-compile flashinfer-jit flashinfer-autotune triton-autotune)
for arg in "$@"; do
  if [ "$arg" = --cpu ]; then NEGATIVES=(torch-compile aot-compile flashinfer-jit); fi
done

t0=$SECONDS
left() { echo $((BUDGET - (SECONDS - t0))); }
OUT=$LOGS/check timeout --kill-after=5 "$(left)" bash scripts/gpu-check.sh "$@" >"$LOGS/check.log" 2>&1
check=$?
grep -E '^(CHECK|  |PHASES|[a-z-]+ (cold|warm restart|restored) |gpu-check:)' "$LOGS/check.log"
[ "$check" -ge 124 ] && echo "gpu-device-run: the check ran past the budget of $BUDGET s" | tee -a "$LOGS/summary.txt"
echo "gpu-device-run: the check exited $check after $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
keep check
save
ok=$((check == 0))
incomplete=0
if [ "$check" -le 1 ]; then  # 2: the check could not run (124, 137: stopped); nothing to reuse
  for c in "${NEGATIVES[@]}"; do
    if [ "$(left)" -lt "$NEGATIVE_S" ]; then
      echo "gpu-device-run: negative $c: NOT RUN ($(left) s left of the budget of $BUDGET s)" | tee -a "$LOGS/summary.txt"
      incomplete=1
      continue
    fi
    t=$SECONDS
    OUT=$LOGS/negative-$c timeout --kill-after=5 "$(left)" bash scripts/gpu-check.sh "$@" --reuse --checks "$c" \
      --negative="$c" >"$LOGS/negative-$c.log" 2>&1
    rc=$?
    verdict="FAIL as it must"
    if [ "$rc" -ge 124 ]; then  # timeout's 124, or 137 once it killed: stopped, not a wrong result
      verdict="STOPPED by the budget of $BUDGET s (exit $rc: see negative-$c.log)"
      incomplete=1
    elif [ "$rc" -ne 1 ] || ! grep -q "NEGATIVE CONTROL $c: FAIL as expected" "$LOGS/negative-$c.log"; then
      verdict="WRONG (exit $rc: see negative-$c.log)"
      ok=0
    fi
    grep -E "^CHECK $c:" "$LOGS/negative-$c.log"
    echo "gpu-device-run: negative $c: $verdict in $((SECONDS - t)) s" | tee -a "$LOGS/summary.txt"
    keep "negative-$c"
    save
  done
fi
save && rm -rf "$LOGS"
verdict=$([ "$ok" = 1 ] && echo PASS || echo FAIL)
[ "$ok" = 1 ] && [ "$incomplete" = 1 ] && verdict=INCOMPLETE
echo "gpu-device-run: $verdict in $((SECONDS - t0)) s; logs in $OUT/gpu-run.tar.gz"
[ "$verdict" = PASS ]
