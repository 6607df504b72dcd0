# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup browser run test lint typecheck bench clean reliability-report

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
browser: setup
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

# One pytest process by default. TEST_WORKERS=2 runs two (pytest-xdist), each on a lane of
# modules chosen by hand in tests/support/lanes.py, which `--dist loadgroup` selects: about 17
# min against 21-28 serially on CI's 2 cores, but each run so far has had 1-4 timing tests fail
# from the CPU contention (a different set each time): not the default until they hold on a busy
# machine. More than 2 gain nothing (two lanes). Where the time goes: docs/testing.md.
TEST_WORKERS ?= 0

test: lint typecheck browser
	$(BIN)/pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadgroup

# The chaos suite writes its report to var/reports/ on every run; publish the last one.
reliability-report:
	test -f var/reports/reliability.md || { echo "no report yet: run the chaos suite (make test)"; exit 1; }
	cp var/reports/reliability.md docs/reliability.md

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) var .mypy_cache .ruff_cache .pytest_cache
