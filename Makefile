# vLLM ROCm AITER patch series. `make help` lists the verbs.
# The two commands of a fresh machine: `make apply` then `make test`.

PYTHON     ?= python3
VENV       ?= .venv
BUILD      ?= build
TREE       := $(BUILD)/vllm
VPY        := $(VENV)/bin/python
# The GPU machine has torch + triton but no vllm and no venv: use its python.
GPU_PYTHON ?= python3
# make test-gpu-backend installs .gpu_payload/ (make gpu-payload) here.
GPU_SITE   ?= /tmp/site
# The payload's wheels and pruned vLLM, installed into GPU_SITE (the GPU verbs' first step).
define GPU_SITE_INSTALL
@test -f .gpu_payload/vllm-src.zip || { echo "no .gpu_payload/: run make gpu-payload (and carry .gpu_payload)" >&2; exit 2; }
$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .gpu_payload/whl/*.whl
rm -rf $(GPU_SITE)/vllm && $(GPU_PYTHON) -m zipfile -e .gpu_payload/vllm-src.zip $(GPU_SITE)
endef
# tests/mla's `gpu` tests, in a process of their own (-m gpu: the other tests are the CPU tier's).
GPU_MLA_TESTS = PYTHONPATH=$(GPU_SITE):. $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests/mla $(PYTEST_ARGS)
# make test TESTS="tests/series tests/order": the test folders/files to run (default: all).
TESTS      ?= tests
PYTEST_ARGS ?=
FORCE      ?=
# make bench writes here (default benchmarks/results/); make bench-host defaults to an ignored folder.
BENCH_OUT  ?=
HOST_BENCH_OUT ?= $(BUILD)/results
# make validate-rocm (docs/rocm.md) writes build/validate-rocm/<date>-<device>-<commit>/
# unless VALIDATE_OUT= is given.
VALIDATE_OUT ?=
# make sweep writes here (default an ignored folder named after the config file).
SWEEP_OUT  ?=
# make rebase VLLM_VERSION=X VLLM_SDIST_SHA256=Y, then CONTINUE=1 or ABORT=1.
VLLM_VERSION ?=
VLLM_SDIST_SHA256 ?=
CONTINUE   ?=
ABORT      ?=
# One clear line (exit 2) when GPU_PYTHON lacks what a GPU verb imports.
NEED       = @$(GPU_PYTHON) scripts/require_modules.py
# make pr / build / image (docs/prs-wheels-image.md).
TOPIC      ?=
DEVICE     ?= auto
BASE_IMAGE ?=

SERIES := $(PYTHON) scripts/series.py --build $(TREE)

.DEFAULT_GOAL := help
.PHONY: help apply check refresh rebase fetch readme venv test test-upstream test-gpu gpu-payload gpu-triton-payload test-gpu-backend test-gpu-mla bench bench-host report compile-report sweep sweep-report e2e validate-rocm clean

help: ## List the verbs
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

fetch: ## Download the pinned vLLM sdist (hash-checked, cached outside the tree)
	@$(SERIES) fetch

apply: ## Build build/vllm: pristine vLLM, overlay, one commit per patch (FORCE=1 discards local work)
	@$(SERIES) apply $(if $(FORCE),--force)

check: ## Lint the series: entries, headers, zero-fuzz apply, no overlay shadowing, relative doc links, upstream's pre-commit hooks
	@$(SERIES) check

refresh: ## Regenerate patches/ and vllm_overlay/ from commits in build/vllm
	@$(SERIES) refresh

rebase: ## Port the series to another vLLM: VLLM_VERSION=X VLLM_SDIST_SHA256=Y; then CONTINUE=1 or ABORT=1
	@$(SERIES) rebase $(if $(ABORT),--abort,$(if $(CONTINUE),--continue,--version "$(VLLM_VERSION)" --sha256 "$(VLLM_SDIST_SHA256)"))

readme: ## Regenerate README.md's series table from the patch headers
	@$(SERIES) readme

venv: apply ## Create/update .venv for the CPU tier (CPU torch, triton, vLLM's common requirements)
	@$(MAKE) -s --no-print-directory $(VENV)/.series-venv-stamp

# One pip resolution (so nothing can pull a CUDA torch), rerun when an input is newer than the stamp.
pin = $(shell sed -n 's/^$(1)=//p' pins.env)
$(VENV)/.series-venv-stamp: pins.env ci/requirements-test.txt $(TREE)/requirements/common.txt
	@echo "venv: pip install into $(VENV) (first time: about 2.8 GB, a few minutes) ..." >&2
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==$(call pin,TORCH_CPU_VERSION) triton==$(call pin,TRITON_VERSION) numba==$(call pin,NUMBA_VERSION) -r ci/requirements-test.txt -r $(TREE)/requirements/common.txt
	touch $@

test: apply venv ## CPU tier: series mechanics, engine logic, kernels under TRITON_INTERPRET=1 (TESTS= narrows)
	PYTHONPATH=$(TREE) VLLM_BUILD_TREE=$(abspath $(TREE)) $(VPY) -m pytest -q -p no:cacheprovider $(TESTS) $(PYTEST_ARGS)

test-upstream: apply venv ## Upstream's own tests on the patched tree vs the pristine record (RECORD=1: rerecord it), against tests/upstream/upstream_tests.toml
	$(PYTHON) scripts/upstream_tests.py --tree $(TREE) --python $(abspath $(VPY)) $(if $(RECORD),--record)

test-gpu: ## GPU tier: kernel tests compiled at real sizes (needs only torch + triton + pytest)
	$(NEED) test-gpu torch triton pytest
	PYTHONPATH=vllm_overlay:tests/without_vllm:. $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/kernels $(PYTEST_ARGS)

gpu-payload: apply venv ## Pack what test-gpu-backend / test-gpu-mla import (pruned vLLM + cp312 wheels) into .gpu_payload/
	@$(PYTHON) scripts/gpu_payload.py --tree $(TREE) --venv $(VENV)

gpu-triton-payload: ## The target's Triton (TRITON_VERSION, or TRITON=x.y.z) trimmed and split for the GPU machine: .gpu_payload/triton/
	@$(PYTHON) scripts/gpu_triton_payload.py build $(if $(TRITON),--version $(TRITON))

test-gpu-backend: ## GPU tier, vLLM from .gpu_payload/ (carry it): AITER FA's extend path vs dense attention; tests/mla's gpu tests
	$(NEED) test-gpu-backend torch triton pytest
	$(GPU_SITE_INSTALL)
	# Separate processes: on the GPU machine's torch 2.11, importing vLLM after
	# the fake tests have registered their torch.library ops fails inside
	# torch._inductor ("'CustomDecompTable' object is not a mapping"); each file
	# passes alone (benchmarks/results/logs/*-16dbe25-backend-*-alone.log).
	PYTHONPATH=$(GPU_SITE):. $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/aiter_fa/test_extend_path.py $(PYTEST_ARGS)
	PYTHONPATH=$(GPU_SITE):. $(GPU_PYTHON) -m pytest -q -p no:cacheprovider tests/aiter_fa/test_aiter_fa_fakes.py $(PYTEST_ARGS)
	$(GPU_MLA_TESTS)

test-gpu-mla: ## GPU tier: only tests/mla's gpu tests (the fused MLA decode's CUDA-graph replay), vLLM from .gpu_payload/
	$(NEED) test-gpu-mla torch triton pytest
	$(GPU_SITE_INSTALL)
	$(GPU_MLA_TESTS)

bench: ## Kernel benchmarks on the GPU at hand; writes benchmarks/results/<date>-<device>-<commit>.json
	$(NEED) bench torch triton pytest pytest_benchmark
	PYTHONPATH=vllm_overlay:tests/without_vllm:. $(GPU_PYTHON) scripts/run_bench.py $(if $(BENCH_OUT),--out $(BENCH_OUT)) $(PYTEST_ARGS)

bench-host: apply venv ## Host-side (CPU) benchmarks (batch-order cost per step; 0302's AITER wrapper vs a plain call) into build/results/ (BENCH_OUT= to keep)
	PYTHONPATH=$(TREE) VLLM_BUILD_TREE=$(abspath $(TREE)) $(VPY) scripts/run_bench.py --out $(or $(BENCH_OUT),$(HOST_BENCH_OUT)) --suite order_host --suite aiter_mla_host $(PYTEST_ARGS)

report: ## Turn committed benchmarks/results/*.json into the README status table and benchmarks/RESULTS.md; flag hand-typed figures
	$(if $(wildcard $(VPY)),$(VPY),$(PYTHON)) scripts/bench_report.py

compile-report: venv ## AMD compile tier: benchmarks/results/compile/<target>.json, docs/compile-tier.md + roofline-amd.md
	$(VPY) scripts/compile_tier.py report

sweep: ## Ray sweep: CONFIG=ci/sweeps/smoke-fake.yaml [ADDRESS=auto] [FORCE=1]; into build/sweeps/<config>/ (SWEEP_OUT=)
	$(if $(wildcard $(VPY)),$(VPY),$(PYTHON)) scripts/sweep.py run $(CONFIG) --out $(or $(SWEEP_OUT),$(BUILD)/sweeps/$(basename $(notdir $(CONFIG)))) $(if $(ADDRESS),--address $(ADDRESS)) $(if $(FORCE),--force)

sweep-report: ## Rewrite and print a sweep's REPORT.md: make sweep-report DIR=build/sweeps/<config>
	$(if $(wildcard $(VPY)),$(VPY),$(PYTHON)) scripts/sweep.py report $(DIR)

e2e: ## ROCm end-to-end recipes: make e2e RECIPES=all MODEL=... UPSTREAM=/path/python PATCHED=/path/python
	$(PYTHON) scripts/e2e.py $(or $(RECIPES),all) --model $(MODEL) $(if $(UPSTREAM),--upstream '$(UPSTREAM)') $(if $(PATCHED),--patched '$(PATCHED)')

validate-rocm: ## ROCm day one: check prerequisites, run every ROCm check, report each claim (MODEL= UPSTREAM= PATCHED= for e2e)
	$(GPU_PYTHON) scripts/validate_rocm.py $(if $(MODEL),--model '$(MODEL)') $(if $(UPSTREAM),--upstream '$(UPSTREAM)') $(if $(PATCHED),--patched '$(PATCHED)') $(if $(VALIDATE_OUT),--out $(VALIDATE_OUT))

clean: ## Remove build outputs (build/, dist/); never the sdist cache or the venv
	rm -rf $(BUILD) dist

.PHONY: pr pr-stack build image
pr: ## Export TOPIC=order-contract|fetch-kv|mla-fusion as an upstream PR: branch pr/TOPIC, dist/TOPIC/
	@$(SERIES) pr --topic "$(TOPIC)"

pr-stack: venv ## After make pr for every topic: git am each PR alone and all stacked on pristine vLLM; run their tests there (CPU)
	@$(SERIES) pr-stack --python $(abspath $(VPY))

build: apply ## Wheel of the patched tree into dist/: ROCm extensions on ROCm, else Python-only (DEVICE=auto|rocm|empty)
	@$(PYTHON) scripts/build_wheel.py --tree $(TREE) --dist dist --device $(DEVICE)

image: ## ROCm image from ci/Dockerfile.rocm (needs a Docker engine; BASE_IMAGE= overrides the base)
	@BASE_IMAGE="$(BASE_IMAGE)" bash ci/image/docker_build.sh
