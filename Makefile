# make kernels | test | bench | gpu-check | sanitize
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
ARCH ?=
LOG_DIR ?= .logs
BENCHES ?= launch kernels overlay ngram_embed cached
SANITIZERS ?= memcheck racecheck initcheck synccheck
SANITIZE_TESTS ?= tests

.PHONY: kernels test bench gpu-check sanitize

kernels:
	$(PYTHON) -m gpu_runtime.precompile $(if $(ARCH),--arch $(ARCH))

test:
	$(PYTHON) -m pytest

bench:
	@for b in $(BENCHES); do echo "== bench.$$b"; PYTHONUNBUFFERED=1 $(PYTHON) -m bench.$$b || exit 1; done

# Every test with GPU tests required (REQUIRE_GPU turns a skipped GPU test into a failure),
# then the benchmarks; logs under $(LOG_DIR).
gpu-check: kernels
	@mkdir -p $(LOG_DIR)
	REQUIRE_GPU=1 $(PYTHON) -m pytest -q 2>&1 | tee $(LOG_DIR)/test.log
	$(MAKE) --no-print-directory bench 2>&1 | tee $(LOG_DIR)/bench.log

# API errors are not reported: the runtime checks every call's status itself, and the tests
# provoke some on purpose (out of memory, missing kernels). Kernel memory errors all count.
sanitize:
	@mkdir -p $(LOG_DIR)
	@for tool in $(SANITIZERS); do \
	  echo "== compute-sanitizer --tool $$tool"; \
	  compute-sanitizer --tool $$tool --error-exitcode 99 --print-limit 20 --report-api-errors no \
	    $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider $(SANITIZE_TESTS) 2>&1 | tee $(LOG_DIR)/sanitize-$$tool.log \
	    || exit 1; \
	done
