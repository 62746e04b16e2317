# The whole set-up is two commands: `make demo` and `make test` (each creates .venv if absent).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-fast lint format bench clean cluster-demo

venv: $(VENV)/.installed

# Re-install when the project's dependencies change. pip takes torch==2.13.0 (CPU) from the
# machine's wheel directory; the pin keeps it from pulling a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

# The whole path on an embedded local cluster: train, ASHA sweep, serve the best, HTTP requests.
demo: venv
	$(BIN)/python jobs/demo.py

# A Ray cluster of 2 "hosts" on this machine, each a network namespace (needs root); it prints
# a `ray job submit` line to try, and removes everything on Ctrl-C. harness/netns_cluster.py.
cluster-demo: venv
	$(BIN)/python harness/netns_cluster.py --hosts 2

# Every tier (what CI runs). The multi-host tier (HOSTS_TIER: a cluster of network-namespace
# hosts of its own, mostly waiting on hosts lost and back) runs in a second pytest process beside
# the rest, which keeps the cores busy while it waits: on 2 cores that took 688 s for 901 s of
# tests run one after the other (this tier and 3 slow modules, 2026-12-07). Its report follows
# the main one's; each ends with its slowest tests and its total, then the whole run's seconds.
HOSTS_TIER := tests/test_many_hosts.py
HOSTS_LOG := .pytest-hosts-tier.log

test: venv
	@start=$$(date +%s); \
	$(BIN)/python -m pytest $(HOSTS_TIER) -p no:cacheprovider --durations=10 > $(HOSTS_LOG) 2>&1 & hosts=$$!; \
	$(BIN)/python -m pytest tests --ignore=$(HOSTS_TIER) --durations=30; main=$$?; \
	wait $$hosts; hosts_rc=$$?; \
	echo "=== $(HOSTS_TIER), run beside the above (exit $$hosts_rc) ==="; cat $(HOSTS_LOG); \
	echo "make test: $$(( $$(date +%s) - start )) s"; \
	test $$main -eq 0 && test $$hosts_rc -eq 0

# The inner loop: pure tests and the shared cluster's quick checks (tests/conftest.py keeps
# anything that starts a cluster of its own in the slow tier).
test-fast: venv
	$(BIN)/python -m pytest tests -m "not slow" --durations=15

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Every benchmark, one after another (~30 min on 2 cores; run it on a quiet machine): their
# figures go to bench/results.jsonl with commit, date and machine, and into README.md and docs/.
bench: venv
	@command -v wrk >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq wrk >/dev/null) || echo "bench: wrk could not be installed" >&2
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
