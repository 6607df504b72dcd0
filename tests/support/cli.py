"""The `exo-tasks` command as tests run it: to its end, with its output captured, and the
tables it prints read back as rows."""

from __future__ import annotations

import re
import subprocess

from tests.support.api import Api
from tests.support.processes import EXO_TASKS, exo_env

# Every time the CLI prints: UTC, to the second, saying so.
UTC_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EXO_TASKS, *args], env=env, capture_output=True, text=True, timeout=60)


def exo_tasks(api: Api, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """A command against `api` (EXO_API_URL), with `token` as EXO_API_TOKEN if given."""
    return run_cli(exo_env(api_url=api.url, **({"api_token": token} if token else {})), *args)


def rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.strip().splitlines()]
