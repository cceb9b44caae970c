# make kernels | test | bench | gpu-check | sanitize
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
ARCH ?=
LOG_DIR ?= .logs
RESULTS ?= bench/RESULTS.md
BENCHES ?= launch kernels overlay ngram_embed cached decode row_reads real_scale host_gather tensor_parallel engram engram_gemm
SANITIZERS ?= memcheck racecheck initcheck synccheck
SANITIZE_TESTS ?= tests
SANITIZE_JOBS ?= 6
SANITIZE_SHARDS ?= 2

.PHONY: kernels test bench gpu-check sanitize

# Incremental: a module is compiled again only when its source, a header it includes, the options,
# the target (ARCH, default this GPU's cubin, compute_90 PTX without a GPU) or NVRTC changed; the
# rest are reported up to date (layers.precompile --help). FORCE=1 compiles every module.
kernels:
	$(PYTHON) -m layers.precompile $(if $(ARCH),--arch $(ARCH)) $(if $(FORCE),--force)

test:
	$(PYTHON) -m pytest

# The benchmarks' log goes to $(LOG_DIR)/bench.log and, when every benchmark ran (BENCHES not
# given), their tables under the machine, commit and date to $(RESULTS) (bench/results.py;
# COMMIT=... names the commit where the tree is no git checkout): a subset never replaces the
# full record.
bench:
	@mkdir -p $(LOG_DIR)
	@for b in $(BENCHES); do echo "== bench.$$b"; PYTHONUNBUFFERED=1 $(PYTHON) -m bench.$$b || exit 1; done \
	  2>&1 | tee $(LOG_DIR)/bench.log
	$(if $(filter file,$(origin BENCHES)),$(PYTHON) -m bench.results $(LOG_DIR)/bench.log --out $(RESULTS) \
	  $(if $(COMMIT),--commit "$(COMMIT)"),@echo "bench: BENCHES given, $(RESULTS) left as it is")

# Every test with GPU tests required (REQUIRE_GPU turns a skipped GPU test into a failure),
# then the benchmarks; logs under $(LOG_DIR).
gpu-check: kernels
	@mkdir -p $(LOG_DIR)
	REQUIRE_GPU=1 $(PYTHON) -m pytest -q 2>&1 | tee $(LOG_DIR)/test.log
	$(MAKE) --no-print-directory bench

# Every GPU test under each compute-sanitizer tool (tests/sanitize.py: one pass per tool, each
# split over SANITIZE_JOBS processes on the one device), then a table of tool, tests, errors.
sanitize: kernels
	@mkdir -p $(LOG_DIR)
	$(PYTHON) -m tests.sanitize $(SANITIZE_TESTS) --log-dir $(LOG_DIR) --jobs $(SANITIZE_JOBS) \
	  --shards $(SANITIZE_SHARDS) --tools $(SANITIZERS) 2>&1 | tee $(LOG_DIR)/sanitize.log
