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
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
: "${OUT:=$(mktemp -d)}"
LOGS=$(mktemp -d)
export WARMER_GPU_CHECK_DIR=${WARMER_GPU_CHECK_DIR:-${TMPDIR:-/tmp}/warmer-gpu-check}
NEGATIVES=(torch-compile aot-compile flashinfer-jit flashinfer-autotune triton-autotune)
for arg in "$@"; do
  if [ "$arg" = --cpu ]; then NEGATIVES=(torch-compile aot-compile flashinfer-jit); fi
done

t0=$SECONDS
OUT=$LOGS/check bash scripts/gpu-check.sh "$@" >"$LOGS/check.log" 2>&1
check=$?
grep -E '^(CHECK|  |PHASES|[a-z-]+ (cold|warm restart|restored) |gpu-check:)' "$LOGS/check.log"
echo "gpu-device-run: the check exited $check after $((SECONDS - t0)) s" | tee "$LOGS/summary.txt"
ok=$((check == 0))
if [ "$check" -le 1 ]; then  # 2: the check could not run; nothing to reuse
  for c in "${NEGATIVES[@]}"; do
    t=$SECONDS
    OUT=$LOGS/negative-$c bash scripts/gpu-check.sh "$@" --reuse --checks "$c" --negative="$c" \
      >"$LOGS/negative-$c.log" 2>&1
    rc=$?
    verdict="FAIL as it must"
    if [ "$rc" -ne 1 ] || ! grep -q "NEGATIVE CONTROL $c: FAIL as expected" "$LOGS/negative-$c.log"; then
      verdict="WRONG (exit $rc: see negative-$c.log)"
      ok=0
    fi
    grep -E "^CHECK $c:" "$LOGS/negative-$c.log"
    echo "gpu-device-run: negative $c: $verdict in $((SECONDS - t)) s" | tee -a "$LOGS/summary.txt"
  done
fi
tar -czf "$OUT/gpu-run.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
echo "gpu-device-run: $([ "$ok" = 1 ] && echo PASS || echo FAIL) in $((SECONDS - t0)) s; logs in $OUT/gpu-run.tar.gz"
[ "$ok" = 1 ]
