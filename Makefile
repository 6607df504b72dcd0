# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint typecheck bench clean reliability-report

setup: $(STAMP)

# Reinstall when the pins change.
$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

run: setup
	$(BIN)/exo-tasks up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy exo_tasks config tests bench

# Two pytest processes (CI has two cores), each taking whole modules, so a module's fixtures
# start once; each process runs its own Redis and stack. TEST_WORKERS=0 runs them in one.
TEST_WORKERS ?= 2

test: lint typecheck
	$(BIN)/pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadfile

# The chaos suite writes its report to var/reports/ on every run; publish the last one.
reliability-report:
	test -f var/reports/reliability.md || { echo "no report yet: run the chaos suite (make test)"; exit 1; }
	cp var/reports/reliability.md docs/reliability.md

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
