# The whole set-up is two commands: `make demo` and `make test` (each creates .venv if absent).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-fast lint format bench clean cluster-demo

venv: $(VENV)/.installed

# Re-install when the project's dependencies change. pip installs torch first: it alone takes
# the pinned CPU build from the machine's wheel directory (uv would download a multi-GB CUDA
# build). uv installs the rest, in parallel: a fresh venv took 93 s instead of pip's 184 s on a
# 2-core Intel Xeon (2026-12-07). Without uv (no index reachable), pip does it all.
# Everything the KubeRay image installs is held at the versions it pins (CONSTRAINTS), so the
# tests run against what ships, and a new release on PyPI changes neither (python-dateutil
# 4.0.0 brought tzdata into a fresh resolution on 2026-12-07).
TORCH_PIN := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
CONSTRAINTS := deploy/kuberay/image-constraints.txt

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check '$(TORCH_PIN)'
	if $(BIN)/python -m pip install --quiet --disable-pip-version-check uv==0.13.10; then \
		$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode \
			--constraint $(CONSTRAINTS) -e '.[dev]'; \
	else \
		$(BIN)/python -m pip install --quiet --disable-pip-version-check \
			--constraint $(CONSTRAINTS) -e '.[dev]'; \
	fi
	touch $@

# The whole path on an embedded local cluster: train, ASHA sweep, serve the best, HTTP requests.
demo: venv
	$(BIN)/python jobs/demo.py

# A Ray cluster of 2 "hosts" on this machine, each a network namespace (needs root); it prints
# a `ray job submit` line to try, and removes everything on Ctrl-C. harness/netns_cluster.py.
cluster-demo: venv
	$(BIN)/python harness/netns_cluster.py --hosts 2

# Every tier (what CI runs), in two pytest processes side by side: the suite is CPU-bound, and
# one process alone leaves a core idle while its tests wait (hosts lost and back, servers
# starting, jobs polled). BESIDE holds the multi-host tier (a cluster of network-namespace hosts
# of its own) and the modules that wait most (CPU-seconds per wall second, measured module by
# module on 2 cores, 2026-12-07); the other process runs the rest. Each report ends with its
# slowest tests and its total; the second follows the first; then the whole run's seconds.
# With api_fuzz, doctor and search_algs here too, this process ended 250 s after the other
# (1,786 s against 1,539 s in CI on 2 cores, 2026-12-07): they moved to the other. Without the
# simulated-node tier, this one (with api_fuzz) ended 236 s before the other (1,711 s against
# 1,947 s, 2026-12-08); that tier is back, and api_fuzz stays.
BESIDE := tests/test_many_hosts.py tests/test_serve_cli.py tests/test_cli.py \
	tests/test_multinode.py tests/test_serve.py tests/test_jobs.py tests/test_api_fuzz.py \
	tests/test_larger_than_memory.py
BESIDE_LOG := .pytest-beside.log

test: venv
	@start=$$(date +%s); \
	$(BIN)/python -m pytest $(BESIDE) -p no:cacheprovider --durations=20 > $(BESIDE_LOG) 2>&1 & beside=$$!; \
	$(BIN)/python -m pytest tests $(addprefix --ignore=,$(BESIDE)) --durations=30; main=$$?; \
	wait $$beside; beside_rc=$$?; \
	echo "=== run beside the above (exit $$beside_rc): $(BESIDE) ==="; cat $(BESIDE_LOG); \
	echo "make test: $$(( $$(date +%s) - start )) s"; \
	test $$main -eq 0 && test $$beside_rc -eq 0

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
