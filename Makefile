# Two entry points for a fresh machine: `make run` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: run test test-all test-fused lint conformance clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build of 2.13.0 is on local disk; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m torchbridge run

test: $(STAMP)
	$(PY) -m ruff check src tests bench scripts
	$(PY) -m pytest -q -ra tests

test-all: $(STAMP)
	TB_SLOW=1 $(PY) -m pytest -q -ra tests

# The eager device suite again with every op recorded and run as fused sequences.
test-fused: $(STAMP)
	TORCHBRIDGE_EAGER_MODE=fused $(PY) -m pytest -q -ra tests/device

lint: $(STAMP)
	$(PY) -m ruff check src tests bench scripts

conformance: $(STAMP)
	$(PY) -m torchbridge.device.conformance --all --write docs/ops.md

clean:
	rm -rf $(VENV) build *.egg-info
