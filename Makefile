# gpud: `make demo` shows the whole thing in a disposable systemd sandbox with a simulated GPU;
# `make test` runs every check CI runs.
PY ?= python3

.PHONY: setup demo run test lint unit bench deb clean

setup:
	scripts/setup

demo: setup
	$(PY) scripts/demo.py

run: setup
	$(PY) -m gpud.daemon --config etc/serves.toml --socket /run/gpud/gpud.sock --state-dir /var/lib/gpud

lint:
	$(PY) -m ruff check gpud tests tools bench scripts
	$(PY) -m mypy

unit:
	$(PY) -m pytest -m 'not sandbox and not slow'

test: setup lint
	$(PY) -m pytest

bench: setup
	$(PY) bench/run.py

deb:
	packaging/build-deb

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
