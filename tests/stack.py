"""Kept for older imports: the harness lives in tests/support/."""

from __future__ import annotations

from tests.support.api import Api as Api
from tests.support.processes import DEFAULT_MAXMEMORY_MB as DEFAULT_MAXMEMORY_MB
from tests.support.processes import EXO_TASKS as EXO_TASKS
from tests.support.processes import Processes as Processes
from tests.support.processes import RedisServer as RedisServer
from tests.support.processes import exo_env as exo_env
from tests.support.processes import free_port as free_port
from tests.support.processes import kill_tree as kill_tree
from tests.support.processes import start_redis as start_redis
from tests.support.processes import wait_http as wait_http
from tests.support.processes import wait_until as wait_until
from tests.support.workers import Worker as Worker
from tests.support.workers import start_worker as start_worker
from tests.support.workers import wait_runner_ready as wait_runner_ready
from tests.support.workers import worker_env as worker_env
