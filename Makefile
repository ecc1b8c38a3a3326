# Two entry points that work on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/gpufrac-agent: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(BIN)/gpufrac-agent
	$(BIN)/gpufrac-agent demo

test: $(BIN)/gpufrac-agent
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

bench: $(BIN)/gpufrac-agent
	$(BIN)/python bench/agent_bench.py

clean:
	rm -rf $(VENV)
