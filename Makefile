# Two entry points for a fresh machine: `make run` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
# Test processes (pytest-xdist). Whole files go to one worker (--dist loadfile), so a file's fixed port
# range and module fixtures stay in one process. Two on CI's 2 cores: most tests are one Python thread
# tracing or compiling (the suite with a cold XLA cache: 644 s with 2 workers; 999 s with 1 and a warm
# cache on the same kind of host). Each worker holds up to ~5 GiB, so more only where the memory is.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

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
	$(PYTEST) tests

test-all: $(STAMP)
	TB_SLOW=1 $(PYTEST) tests

# The eager device suite again with every op recorded and run as fused sequences.
test-fused: $(STAMP)
	TORCHBRIDGE_EAGER_MODE=fused $(PYTEST) tests/device

lint: $(STAMP)
	$(PY) -m ruff check src tests bench scripts

conformance: $(STAMP)
	$(PY) -m torchbridge.device.conformance --all --write docs/ops.md

clean:
	rm -rf $(VENV) build *.egg-info
