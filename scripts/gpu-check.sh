#!/usr/bin/env bash
# The prepared GPU check (one H200, no network): warm FlashInfer JIT and torch.compile (Triton)
# under a root, pack it, restore it at the same path, run again in a fresh process with nvcc
# off PATH, and assert that nothing was compiled. One summary line per check; exit 1 on a FAIL.
#
#   bash scripts/gpu-check.sh            on the GPU machine (wheels in .whl/ are installed first)
#   bash scripts/gpu-check.sh --cpu      the same flow on a CPU machine (no FlashInfer op)
#
# The GPU machine has torch, triton, nvcc and ninja but no network; warmer is read from this
# checkout (PYTHONPATH). Bring the rest as wheels in .whl/, made where pip works, e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#     flashinfer-python==0.7.2.post1 apache-tvm-ffi zstandard nvidia-ml-py
# plus whichever of flashinfer's requirements the machine lacks (`pip show` there tells).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda; [ "${1:-}" = "--cpu" ] && DEVICE=cpu
WORK=${WARMER_GPU_CHECK_DIR:-/tmp/warmer-gpu-check}
ROOT=$WORK/root
PY=${PYTHON:-python3}
rm -rf "$WORK"; mkdir -p "$WORK"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl || exit 1
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$(dirname "$(command -v "$PY")"):$PATH"
if [ "$DEVICE" = cpu ]; then
  mkdir -p "$WORK/stub" && gcc -shared -o "$WORK/stub/libcuda.so" -x c /dev/null
  export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_EXTRA_LDFLAGS="-L$WORK/stub"
fi
RECIPE=scripts/gpu-check.toml
# Every cache env var under the root, exactly as warmer serves them.
eval "$("$PY" -c "
import shlex, sys; from pathlib import Path; from warmer import components
for k, v in components.cache_env(Path(sys.argv[1])).items(): print(f'export {k}={shlex.quote(v)}')" "$ROOT")"
"$PY" -c "import sys; from pathlib import Path; from warmer import warmup, recipe
warmup.prepare_root(Path(sys.argv[1]))" "$ROOT"

fail=0
check() {  # check NAME CONDITION DETAIL
  if [ "$2" = 1 ]; then echo "CHECK $1: PASS ($3)"; else echo "CHECK $1: FAIL ($3)"; fail=1; fi
}

t0=$(date +%s%N)
"$PY" scripts/gpu_check.py run "$ROOT" "$WORK/cold.json" --device "$DEVICE" >"$WORK/cold.log" 2>&1
rc=$?; t1=$(date +%s%N)
check cold-run "$([ $rc = 0 ] && echo 1)" "exit $rc in $(( (t1 - t0) / 1000000 )) ms; log $WORK/cold.log"
[ $rc = 0 ] || { tail -20 "$WORK/cold.log"; exit 1; }

"$PY" -m warmer pack "$ROOT" --recipe "$RECIPE" -o "$WORK/artifact.tar.zst" --json >"$WORK/pack.json"
check pack "$([ $? = 0 ] && echo 1)" "$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['files'], 'files,', d['archive_bytes'], 'bytes')" "$WORK/pack.json")"

rm -rf "$ROOT"
"$PY" -m warmer restore "$WORK/artifact.tar.zst" --root "$ROOT" --json >"$WORK/restore.json"
check restore "$([ $? = 0 ] && echo 1)" "$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['status'], 'in', d['seconds'], 's')" "$WORK/restore.json")"

# The warm run: a fresh process, nvcc nowhere on PATH.
WARM_PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd:)
"$PY" -c "import sys; from pathlib import Path; from warmer import verify; import json
json.dump(verify.snapshot(Path(sys.argv[1])), open(sys.argv[2], 'w'))" "$ROOT" "$WORK/before.json"
t0=$(date +%s%N)
PATH="$WARM_PATH" "$PY" scripts/gpu_check.py run "$ROOT" "$WORK/warm.json" --device "$DEVICE" >"$WORK/warm.log" 2>&1
rc=$?; t1=$(date +%s%N)
check warm-run-without-nvcc "$([ $rc = 0 ] && ! PATH="$WARM_PATH" command -v nvcc >/dev/null && echo 1)" \
  "exit $rc in $(( (t1 - t0) / 1000000 )) ms; log $WORK/warm.log"
[ $rc = 0 ] || { tail -20 "$WORK/warm.log"; exit 1; }

"$PY" - "$ROOT" "$WORK" <<'PYEOF'
import json, sys
from pathlib import Path
from warmer import verify
root, work = Path(sys.argv[1]), Path(sys.argv[2])
warm, cold = json.loads((work / "warm.json").read_text()), json.loads((work / "cold.json").read_text())
before = {k: tuple(v) for k, v in json.loads((work / "before.json").read_text()).items()}
d = verify.delta(before, verify.snapshot(root))
dry = warm["flashinfer_dry_run"]
ind = warm["inductor"]
lines = [
    ("flashinfer-ninja-dry-run", dry["clean"] is True and len(dry["modules"]) >= 1,
     f"{len(dry['modules'])} module(s): " + ", ".join(f"{m} {'no work to do' if r['clean'] else r['reasons'][:1]}"
                                                    for m, r in dry["modules"].items())),
    ("inductor-fxgraph-cache", ind.get("fxgraph_cache_hit", 0) >= 1 and ind.get("fxgraph_cache_miss", 0) == 0,
     f"hits {ind.get('fxgraph_cache_hit', 0)}, misses {ind.get('fxgraph_cache_miss', 0)}; cold run: "
     f"hits {cold['inductor'].get('fxgraph_cache_hit', 0)}, misses {cold['inductor'].get('fxgraph_cache_miss', 0)}"),
    ("no-new-cache-files", d["recompiled_files"] == 0,
     f"{d['new_files']} new, {d['rewritten_files']} rewritten, by component {d['by_component']}, e.g. {d['examples'][:3]}"),
    ("results-correct", warm["compile_max_err"] < 1e-3 and warm.get("flashinfer_op_max_err", 0) < 1e-2,
     f"compile err {warm['compile_max_err']:.2e}, flashinfer err {warm.get('flashinfer_op_max_err', 'n/a')}"),
]
for name, ok, detail in lines:
    print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} ({detail})")
sys.exit(0 if all(ok for _, ok, _ in lines) else 1)
PYEOF
[ $? = 0 ] || fail=1
echo "gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
