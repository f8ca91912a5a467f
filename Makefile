# Set-up is idempotent: the first target that needs the virtual environment builds it.
# torch is installed first and pinned: an unpinned `torch` can pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0

.PHONY: setup demo lint test bench clean

$(BIN)/vllm-trace: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

setup: $(BIN)/vllm-trace

demo: setup  ## the TUI on the built-in offline model (send requests from a second terminal)
	$(BIN)/vllm-trace serve tiny-gpt2

lint: setup  ## ruff: line length, pyflakes, import order (configured in pyproject.toml)
	$(BIN)/ruff check .

test: setup  ## the whole test suite
	$(BIN)/python -m pytest

bench: setup  ## benchmarks (each prints ratios measured side by side in one run)
	$(BIN)/python -m benchmarks.throughput

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
