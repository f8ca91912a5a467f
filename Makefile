# Set-up is idempotent: the first target that needs the virtual environment builds it.
# torch is installed first and pinned: an unpinned `torch` can pull a multi-GB CUDA build.
# pip shows what it fetches and installs (the set-up takes a minute or two): a silent minute
# reads as a hang. Only its "already satisfied" lines are left out.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP    := $(BIN)/pip install --disable-pip-version-check --progress-bar on
SHOW   := { grep --line-buffered -v '^Requirement already satisfied' || true; }

.PHONY: setup demo lint test bench screenshot clean

$(BIN)/vllm-trace: pyproject.toml
	@echo "==> setting up $(VENV), once (a minute or two): $(TORCH), then vllm-trace and its test tools"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [1/2] $(TORCH) (pinned and first: a plain torch can pull a multi-GB CUDA build)"
	@$(PIP) $(TORCH) | $(SHOW)
	@echo "==> [2/2] vllm-trace (editable) with its test extras"
	@$(PIP) -e '.[dev]' | $(SHOW)
	touch $@
	@echo "==> $(VENV) is ready"

setup: $(BIN)/vllm-trace

demo: setup  ## the TUI on the built-in offline model (send requests from a second terminal)
	$(BIN)/vllm-trace serve tiny-gpt2

lint: setup  ## ruff: line length, pyflakes, import order (configured in pyproject.toml)
	$(BIN)/ruff check .

test: setup  ## the whole test suite
	$(BIN)/python -m pytest

screenshot: setup  ## the README's picture of the TUI (docs/images/tui.svg), drawn again by Textual
	$(BIN)/python -m tests.tui.test_readme_screenshot

bench: setup  ## benchmarks (each prints ratios measured side by side in one run)
	$(BIN)/python -m benchmarks.throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
