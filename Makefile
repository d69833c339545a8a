# gpud: `make demo` shows the whole thing in a disposable systemd sandbox with a simulated GPU;
# `make test` runs every check CI runs. Everything runs in the project's virtualenv, .venv/
# (made by scripts/setup), never in the system's interpreter.
# What each target needs is set up by tiers: `setup` what gpud and the demo run (scripts/setup),
# `setup-test` the test tools besides (scripts/setup-test), `setup-vllm` real vLLM's CPU build for
# the tests marked vllm (scripts/setup-vllm: torch and vLLM, 3.5 GiB). `make demo` sets up only
# the first; `make test` all three.
PY := .venv/bin/python

.PHONY: setup setup-test setup-vllm setup-deb demo run test lint unit bench mutation coverage deb docs clean distclean

setup:
	scripts/setup

setup-test:
	scripts/setup-test

setup-vllm:
	scripts/setup-vllm

setup-deb:
	scripts/setup-deb

# DEMO_ARGS=--keep leaves the demo's sandbox running to look around in (its last lines say how
# to enter it and power it off).
DEMO_ARGS ?=
demo: setup
	$(PY) scripts/demo.py $(DEMO_ARGS)

run: setup
	$(PY) -m gpud.daemon --config etc/serves.toml --socket /run/gpud/gpud.sock --state-dir /var/lib/gpud

lint: setup-test
	$(PY) -m ruff check gpud tests tools bench scripts
	$(PY) -m mypy

unit: setup-test
	$(PY) -m pytest -m 'not sandbox and not slow and not build'

test: setup-test setup-vllm lint
	$(PY) -m pytest

bench: setup-test
	$(PY) bench/run.py

# Mutation score of the pure core, per module (tools/mutate.py; not part of `make test`).
mutation: setup-test
	$(PY) tools/mutate.py --min 95

# Line coverage of gpud by the tests, the daemons and clients they start included (not part of
# `make test`; [tool.coverage] in pyproject.toml). TESTS picks what runs: the default is the
# unit tests; TESTS=tests measures everything, sandbox included; the direct tests of the service,
# supervisor and rebalance alone:
#   make coverage TESTS="tests/test_service.py tests/test_supervisor_direct.py tests/test_rebalance_direct.py"
TESTS ?= -m 'not sandbox and not slow'
coverage: setup-test
	rm -f .coverage .coverage.*
	$(PY) -m coverage run -m pytest $(TESTS)
	$(PY) -m coverage combine -q
	$(PY) -m coverage report

# gpuctl(1), gpud(8), the bash/zsh completion and the dashboard's state panel are generated from
# gpud's own tables; tests fail when they are stale
docs: setup
	$(PY) scripts/manpage.py
	$(PY) scripts/completion.py
	$(PY) scripts/dashboard.py

# The package needs the demo's tier and dpkg-deb and strip (scripts/setup-deb), not the test tools.
deb: setup-deb
	PYTHON=$(PY) packaging/build-deb

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis .coverage .coverage.*

distclean: clean
	rm -rf .venv .venv-vllm
