"""Which pytest-xdist process runs which module under `--dist loadgroup` (`make test`): two
lanes chosen by hand, so that two processes on two cores finish together, the session's hosts
start once, and a module timing stops runs beside one that mostly waits. The figures behind
the lanes: docs/testing.md. In one process (no `-n`) only the check of the table applies.

Our scheduler, not xdist's own loadgroup: with pytest 9.2 that groups nothing, for it marks a
group by rewriting each test's node id, which pytest no longer reads (pytest-xdist#1386)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

# The session fixtures that start workers: each starts once in the whole run, in the process
# of the lane HOSTS, so every module using one must be there (checked at collection).
SESSION_HOSTS = frozenset({"stack", "fleet"})

# Each lane in its order. Beside OWN's stop timings of test_stack_stop, HOSTS first runs
# modules that mostly wait (heartbeat expiries, idle timeouts); test_shutdown (stop timings, its
# own workers' CPU) then runs beside OWN's modules that mostly wait (failover, SIGKILLed hosts
# and Redis, chaos kills). The modules using the fleet come last: it idles less.
LANES: dict[str, tuple[str, ...]] = {
    "hosts": (
        "tests/test_recovery.py",
        "tests/test_idle_unload.py",
        "tests/test_shutdown.py",
        "tests/chaos/test_hostile.py",
        "tests/chaos/test_long_prompts.py",
        "tests/chaos/test_prompt_flood.py",
        "tests/chaos/test_slow_clients.py",
        "tests/chaos/test_storage.py",
        "tests/test_auth.py",
        "tests/test_batches.py",
        "tests/test_cancel.py",
        "tests/test_cli.py",
        "tests/test_cli_batch.py",
        "tests/test_cli_client.py",
        "tests/test_cli_terminal.py",
        "tests/test_clients.py",
        "tests/test_control.py",
        "tests/test_fairness.py",
        "tests/test_front_door.py",
        "tests/test_jobs.py",
        "tests/test_limits.py",
        "tests/test_metrics.py",
        "tests/test_openai.py",
        "tests/test_openapi.py",
        "tests/test_pool_fork.py",
        "tests/test_runners.py",
        "tests/test_streams.py",
        "tests/test_validation.py",
        "tests/test_fleet.py",
        "tests/test_flower.py",
        "tests/test_flower_pages.py",
        "tests/test_instance_routing.py",
        "tests/test_instances_api.py",
    ),
    # Modules with Redis and workers of their own.
    "own": (
        "tests/test_stack_stop.py",
        "tests/test_ha.py",
        "tests/test_batch_recovery.py",
        "tests/chaos/test_chaos.py",
        "tests/test_instance_faults.py",
        "tests/test_instance_ranks.py",
        "tests/test_instance_stack.py",
        "tests/chaos/test_fuzz.py",
        "tests/test_batch_hostile.py",
        "tests/test_prompt_cache.py",
        "tests/test_engine.py",
        "tests/test_chat_text.py",
        "tests/test_lost_ending.py",
    ),
}
# Any other module (unit tests, store, config ...: seconds each) is a unit of its own, after
# the lanes, for whichever process is free first.
LANE_OF = {module: lane for lane, modules in LANES.items() for module in modules}
HOSTS = "hosts"


def module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


class Lanes(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no types
    """xdist's scheduling by scope, a scope being a lane or else a module; the scopes in the
    collection's order, which the workers sort by lane (below)."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        config.option.loadscopereorder = False
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return LANE_OF.get(module, module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Lanes | None:
    return Lanes(config, log) if config.getoption("dist") == "loadgroup" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(module_of(item.nodeid), []).append(item)
    for module, tests in modules.items():
        _check_lane(module, tests)
    if getattr(config.option, "loadgroup", False):  # an xdist process of `--dist loadgroup`
        ordered = sorted(modules, key=_rank)
        items[:] = [item for module in ordered for item in modules[module]]


def _check_lane(module: str, tests: Sequence[pytest.Item]) -> None:
    if LANE_OF.get(module) != HOSTS and any(
        SESSION_HOSTS.intersection(getattr(item, "fixturenames", ())) for item in tests
    ):
        raise pytest.UsageError(
            f"{module} uses a session host ({', '.join(sorted(SESSION_HOSTS))}): list it in "
            f"the lane {HOSTS!r} of tests/support/lanes.py"
        )


def _rank(module: str) -> tuple[int, int]:
    """Lane by lane, each in its order; then the other modules (sorted is stable)."""
    for number, modules in enumerate(LANES.values()):
        if module in modules:
            return number, modules.index(module)
    return len(LANES), 0
