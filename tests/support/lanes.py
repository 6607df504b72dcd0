"""Which pytest-xdist process runs which module under `--dist loadgroup` (`make test`): three
lanes chosen by hand, so that three processes finish together, each session host starts once
per process that needs it, and the modules that mostly wait (stop bounds, heartbeat expiries,
failovers) are spread over the lanes. Three on two cores: the suite waits more than it
computes (about one core busy on average with two processes). The figures behind the lanes:
docs/testing.md. In one process (no `-n`) only the check of the table applies.

Our scheduler, not xdist's own loadgroup: with pytest 9.2 that groups nothing, for it marks a
group by rewriting each test's node id, which pytest no longer reads (pytest-xdist#1386)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

# The session fixtures that start workers: each starts at most once per process, in the lanes
# that may use them (checked at collection), so no other lane pays for their start.
SESSION_HOSTS: dict[str, frozenset[str]] = {
    "stack": frozenset({"hosts", "fleet"}),
    "fleet": frozenset({"fleet"}),
}

# Each lane in its order (seconds each module took with two processes: docs/testing.md).
LANES: dict[str, tuple[str, ...]] = {
    # The session's stack: stop timings and recovery (mostly waiting), then the rest.
    "hosts": (
        "tests/test_recovery.py",
        "tests/test_direct.py",
        "tests/test_idle_unload.py",
        "tests/test_shutdown.py",
        "tests/chaos/test_long_prompts.py",
        "tests/chaos/test_storage.py",
        "tests/test_cli_client.py",
        "tests/test_front_door.py",
        "tests/test_control.py",
        "tests/test_pool_size.py",
    ),
    # Modules with workers of their own (CPU, beside the others' waiting), then the session's
    # stack and, last, its fleet.
    "fleet": (
        "tests/test_instance_ranks.py",
        "tests/test_batch_recovery.py",
        "tests/chaos/test_fuzz.py",
        "tests/test_lost_ending.py",
        "tests/test_instance_stack.py",
        "tests/test_batch_hostile.py",
        "tests/chaos/test_hostile.py",
        "tests/chaos/test_prompt_flood.py",
        "tests/chaos/test_slow_clients.py",
        "tests/test_auth.py",
        "tests/test_batches.py",
        "tests/test_cli.py",
        "tests/test_cli_batch.py",
        "tests/test_cli_terminal.py",
        "tests/test_clients.py",
        "tests/test_fairness.py",
        "tests/test_jobs.py",
        "tests/test_limits.py",
        "tests/test_metrics.py",
        "tests/test_openai.py",
        "tests/test_openapi.py",
        "tests/test_pool_fork.py",
        "tests/test_runners.py",
        "tests/test_streams.py",
        "tests/test_validation.py",
        "tests/test_cancel.py",
        "tests/test_prefill_process.py",
        "tests/test_fleet.py",
        "tests/test_flower.py",
        "tests/test_flower_pages.py",
        "tests/test_instance_routing.py",
        "tests/test_instances_api.py",
    ),
    # Redis and workers of their own: whole stacks stopped, Redis failed over, hosts and
    # ranks killed.
    "own": (
        "tests/test_stack_stop.py",
        "tests/test_ha.py",
        "tests/chaos/test_chaos.py",
        "tests/test_instance_faults.py",
        "tests/test_prompt_cache.py",
        "tests/test_engine.py",
        "tests/test_chat_text.py",
    ),
}
# Any other module (unit tests, store, config ...: seconds each) is a unit of its own, after
# the lanes, for whichever process is free first.
LANE_OF = {module: lane for lane, modules in LANES.items() for module in modules}


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
    used = {name for item in tests for name in getattr(item, "fixturenames", ())}
    for host in sorted(used.intersection(SESSION_HOSTS)):
        if LANE_OF.get(module) not in SESSION_HOSTS[host]:
            raise pytest.UsageError(
                f"{module} uses the session's {host!r}: list it in a lane of "
                f"{sorted(SESSION_HOSTS[host])} in tests/support/lanes.py"
            )


def _rank(module: str) -> tuple[int, int]:
    """Lane by lane, each in its order; then the other modules (sorted is stable)."""
    for number, modules in enumerate(LANES.values()):
        if module in modules:
            return number, modules.index(module)
    return len(LANES), 0
