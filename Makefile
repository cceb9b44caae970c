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

# Every GPU test under each compute-sanitizer tool, one pass per tool, then a table of tool,
# tests run and errors (from pytest's summary and the tool's ERROR SUMMARY). API errors are not
# reported: the runtime checks every call's status itself, and the tests provoke some on purpose
# (out of memory, missing kernels). Kernel memory errors all count; any error fails the target.
sanitize:
	@mkdir -p $(LOG_DIR); status=0; \
	for tool in $(SANITIZERS); do \
	  echo "== compute-sanitizer --tool $$tool"; \
	  compute-sanitizer --tool $$tool --error-exitcode 99 --print-limit 20 --report-api-errors no \
	    $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider $(SANITIZE_TESTS) > $(LOG_DIR)/sanitize-$$tool.log 2>&1 \
	    || status=1; \
	  tail -3 $(LOG_DIR)/sanitize-$$tool.log; \
	done; \
	echo; echo "| tool | tests | errors |"; echo "|---|---|---|"; \
	for tool in $(SANITIZERS); do \
	  log=$(LOG_DIR)/sanitize-$$tool.log; \
	  tests=$$(grep -Eo '[0-9]+ (passed|failed)' $$log | paste -sd' ' -); \
	  errors=$$(grep -Eo 'ERROR SUMMARY: [0-9]+' $$log | grep -Eo '[0-9]+$$' | tail -1); \
	  echo "| $$tool | $${tests:-none} | $${errors:-?} |"; \
	done; exit $$status
