#!/usr/bin/env bash
# The prepared GPU check: warm into a root in a cold process, restart warm on that root (the
# control: what every start redoes), `warmer pack`, delete the root, `warmer restore` it to the same
# path, run the same work again in a fresh process with nvcc unreachable (a shadow CUDA_HOME whose
# bin/nvcc logs and fails), fresh HOME, XDG_CACHE_HOME and TMPDIR, and a file census; then one line
# per check, the restored run judged against the warm restart:
#   CHECK name: cold X s, warm restart W s, restored Y s (Rx the warm restart), compiles N (warm
#   restart N'), new files M (warm restart M'), PASS|FAIL
# with what the warm restart redid listed under it ("every start redoes this: a cache does not
# remove it", counter and seconds), and a phase table (interpreter start, import torch, CUDA
# context, work, exit) per check and phase. Results also go to $OUT/gpu-check.json when OUT is set.
# Exit 0 only when every check passed.
#
#   bash scripts/gpu-check.sh                 the H200 run (<= 8 min); --quick (<= 4.5 min)
#   bash scripts/gpu-check.sh --cpu           the same flow on a CPU machine (FlashInfer built, not run)
#   bash scripts/gpu-check.sh --negative[=CHECK]   delete CHECK's cache before the restored run: it must FAIL
#   bash scripts/gpu-check.sh --reuse --negative   ... reusing the cold runs and warm restarts a previous run left
#
# What the GPU machine lacks (flashinfer-python 0.7.0.post1 and apache-tvm-ffi 0.1.11 as vLLM 0.32
# pins them, zstandard, warmer) travels as wheels in .whl/ (`make gpu-wheels`, then carry .whl);
# they are installed here with pip --no-index --no-deps --target. WARMER_GPU_WHEELS picks another
# set (FlashInfer 0.7.2.post1: see the Makefile). PYTHON picks the interpreter (default: python3, or
# .venv/bin/python with --cpu, as scripts/gpu-accept.sh: `make install` puts warmer's deps there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  for arg in "$@"; do
    if [ "$arg" = --cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
  done
fi
WORK=${WARMER_GPU_CHECK_DIR:-${TMPDIR:-/tmp}/warmer-gpu-check}
export WARMER_GPU_CHECK_DIR=$WORK

if [ -n "$(ls -A "$WORK" 2>/dev/null)" ] && [ ! -e "$WORK/.warmer-gpu-check" ]; then
  echo "gpu-check: $WORK is not empty and was not made by gpu-check: set WARMER_GPU_CHECK_DIR" >&2
  exit 2
fi
mkdir -p "$WORK" && echo "work directory of scripts/gpu-check.sh" >"$WORK/.warmer-gpu-check"
WHL=${WARMER_GPU_WHEELS:-.whl}
if compgen -G "$WHL/*.whl" >/dev/null; then
  SITE=$WORK/site
  WHEELS=("$WHL"/*.whl)
  # A set built before warmer's last change carries another warmer than the checkout it travels with:
  # that one would be tested. Then the set's other wheels are installed, and the checkout's warmer runs.
  if ! WHY=$("$PY" scripts/gpu_wheels.py fresh "$WHL"); then
    WHEELS=()
    for w in "$WHL"/*.whl; do [[ $(basename "$w") == warmer-* ]] || WHEELS+=("$w"); done
    echo "gpu-check: $WHY: this checkout's warmer runs instead" >&2
  fi
  STAMP=$(ls -l "${WHEELS[@]}")
  # The set is made for one Python (make gpu-wheels GPU_PYTHON=3.12 by default). An interpreter
  # it does not fit goes on with what it has installed, and says so. (WARMER_GPU_WHEELS: another set.)
  if "$PY" -m pip --version >/dev/null 2>&1; then
    INSTALL=("$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE")
  else  # a Python without pip: the same layout, unzipped (scripts/gpu_wheels.py unpack)
    INSTALL=("$PY" scripts/gpu_wheels.py unpack --target "$SITE")
  fi
  t0=$SECONDS
  if [ -f "$SITE/.installed-from" ] && [ "$(cat "$SITE/.installed-from")" = "$STAMP" ]; then
    echo "gpu-check: the wheels from $WHL are already installed in $SITE"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  elif rm -rf "$SITE" && "${INSTALL[@]}" "${WHEELS[@]}" >"$WORK/pip.log" 2>&1; then
    echo "$STAMP" >"$SITE/.installed-from"
    echo "gpu-check: installed ${#WHEELS[@]} wheels from $WHL in $((SECONDS - t0)) s"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu-check: the wheels in $WHL do not install into $("$PY" -V 2>&1) (see $WORK/pip.log);" \
         "going on with the packages this Python has" >&2
  fi
fi
# After the wheels: an installed warmer (the carried wheel, when fresh) is the one that packs and restores.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
exec "$PY" scripts/gpu_check.py "$@"
