"""The harness's fixtures live in tests/support/fixtures.py; tests import helpers from
tests/support/, never from here."""

pytest_plugins = ["tests.support.fixtures"]
