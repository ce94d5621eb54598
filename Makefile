# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the dependency lists change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) agent-mcp.py $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/turn_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
