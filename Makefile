# The two commands the README opens with. Each installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

## Run the example end to end (migrate, worker, relay, a partner sync fan-out) and print its report.
demo: install
	$(BIN)/python -m example_app.demo

## Run the whole test suite against the local PostgreSQL, Redis and RabbitMQ.
test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check celery_fanin tests example_app
	$(BIN)/ruff format --check celery_fanin tests example_app
	$(BIN)/mypy
