# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench bench-db bench-proxy bench-first bench-budget bench-api bench-mcp bench-approvals bench-slack-approvals bench-elicitation bench-guard bench-grants bench-scale bench-growth bench-floor bench-local bench-metrics bench-mcp-sandbox dashboard metrics clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the dependency lists change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) agent-mcp.py $(ARGS)

# One pytest worker more than the cores: a test spends part of its time waiting for the servers it started
# (on 2 cores, 3 workers ran the suite in 537 and 553 s where 2 took 614-663 s and 4 took 637 s).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print((os.cpu_count() or 1) + 1)")

# mypy checks the whole tree as [tool.mypy] in pyproject.toml says (its cache in .mypy_cache).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/turn_overhead.py

# LiteLLM needs openai<3 (the agent uses 3.x), so it gets a venv of its own inside .venv.
LITELLM := $(VENV)/litellm/bin/litellm
$(LITELLM): bench/litellm-requirements.txt | $(PY)
	$(PYTHON) -m venv $(VENV)/litellm
	$(VENV)/litellm/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/litellm/bin/python -m pip install --quiet -r bench/litellm-requirements.txt
	touch $(LITELLM)

bench-proxy: $(STAMP) $(LITELLM)
	$(PY) bench/proxy_overhead.py --litellm $(LITELLM)

bench-db: $(STAMP)
	$(PY) bench/db_enforcement.py

bench-budget: $(STAMP)
	$(PY) bench/budget_cost.py

bench-first: $(STAMP)
	$(PY) bench/first_request.py

bench-api: $(STAMP)
	$(PY) bench/api_overhead.py

bench-mcp: $(STAMP)
	$(PY) bench/mcp_approvals.py

bench-approvals: $(STAMP)
	$(PY) bench/approvals_latency.py

bench-slack-approvals: $(STAMP)
	$(PY) bench/slack_approvals.py

bench-elicitation: $(STAMP)
	$(PY) bench/elicitation_latency.py

bench-guard: $(STAMP)
	$(PY) bench/guard_overhead.py

bench-grants: $(STAMP)
	$(PY) bench/grant_cost.py

# Metrics on vs off: server CPU per turn and per token (docs/benchmarks.md).
bench-metrics: $(STAMP)
	$(PY) bench/metrics_overhead.py

# Needs Debian's bubblewrap (apt-get install bubblewrap): the start-up cost of a sandboxed stdio MCP server.
bench-mcp-sandbox: $(STAMP)
	$(PY) bench/mcp_sandbox.py

# Needs Debian's prometheus (apt-get install prometheus): runs every query of deploy/grafana-agent-mcp.json against
# a Prometheus that scraped a minute of traffic, and draws the main panels into docs/dashboard.svg.
dashboard: $(STAMP)
	$(PY) bench/dashboard.py

# Needs the machine's Redis at 127.0.0.1:6379 (keys under a prefix of its own, removed after).
bench-scale: $(STAMP)
	$(PY) bench/scale.py

# Costs as work grows (history, stored sessions, SSE subscribers, concurrency, memory): ~30 min here.
bench-growth: $(STAMP)
	$(PY) bench/growth.py $(ARGS)

# The same shell turn or proxied stream built from the libraries alone, against agent-mcp's (docs/benchmarks.md).
bench-floor: $(STAMP)
	$(PY) bench/floor.py --path shell $(ARGS)
	$(PY) bench/floor.py --path proxy $(ARGS)

# A real local model behind any OpenAI-compatible URL (default: the shared local model on 127.0.0.1:8081);
# skips with a message when nothing answers there. Slow (minutes): not part of `make test`.
# ARGS='--base-url http://127.0.0.1:8080/v1 --label 1.5B'
bench-local: $(STAMP)
	$(PY) bench/local_model.py $(ARGS)

metrics: $(STAMP)
	$(VENV)/bin/radon cc --total-average -n C -s *.py plugins/*.py
	wc -l *.py plugins/*.py | sort -n | tail -8

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
