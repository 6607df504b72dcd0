"""The harness's fixtures live in tests/support/fixtures.py, the pytest-xdist lanes in
tests/support/lanes.py; tests import helpers from tests/support/, never from here."""

pytest_plugins = ["tests.support.fixtures", "tests.support.lanes"]
