# Two commands on a fresh clone: `make demo` (the broker on the default config plus a short client load)
# and `make test`. Both create the virtual environment on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/shmbroker: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[serve,http,build,dev]'
	touch $@

demo: $(BIN)/shmbroker
	$(BIN)/shmbroker bench --quick

test: $(BIN)/shmbroker
	$(BIN)/python -m pytest -q

lint: $(BIN)/shmbroker
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(BIN)/shmbroker
	mkdir -p bench/out
	$(BIN)/shmbroker bench --json --out bench/out/result.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
