# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser run test suite lint typecheck bench clean reliability-report

setup: $(STAMP)

# Reinstall when the pins change.
$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

# The headless browser of tests/test_flower_pages.py: Debian's Chromium where apt-get is and we
# are root (CI), else Playwright's own build (a download of its own, which CI's network refuses).
# Only Playwright's needs the venv: apt-get's download (about 40 s) runs beside pip's.
SYSTEM_BROWSER := $(shell command -v chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get; })
browser: $(if $(SYSTEM_BROWSER),,setup)
	@if command -v chromium >/dev/null; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q --no-install-recommends chromium \
		|| { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }; \
	else $(BIN)/playwright install chromium; fi

run: setup
	$(BIN)/exo-tasks up

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy exo_tasks config tests bench

# Three pytest processes (pytest-xdist) on two cores, for the suite waits more than it
# computes: each on a lane of modules chosen by hand in tests/support/lanes.py, which
# `--dist loadgroup` selects: under 10 minutes on a fresh clone against 17-18 in one process
# (TEST_WORKERS=0; docs/testing.md). ruff, mypy (one core for a minute) and the browser's
# install run beside them.
TEST_WORKERS ?= 3

test:
	$(MAKE) --no-print-directory -j3 lint typecheck suite

suite: setup browser
	$(BIN)/pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadgroup

# The chaos suite writes its report to var/reports/ on every run; publish the last one.
reliability-report:
	test -f var/reports/reliability.md || { echo "no report yet: run the chaos suite (make test)"; exit 1; }
	cp var/reports/reliability.md docs/reliability.md

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
