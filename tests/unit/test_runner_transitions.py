"""The runner's state machine as data (exo_tasks.lifecycle.RUNNER_TRANSITIONS), walked: every
status reachable from a spawn, an ended runner never back to life but by a new spawn, and each
move the table does not have refused and logged, never raised."""

from __future__ import annotations

import itertools
import logging

import pytest

from exo_tasks import lifecycle
from exo_tasks.fleet_types import RunnerState, RunnerStatus
from exo_tasks.lifecycle import RUNNER_ENDINGS, RUNNER_TRANSITIONS
from tests.unit.tables import reachable

RS = RunnerStatus
MOVES = {(a, b) for a, targets in RUNNER_TRANSITIONS.items() for b in targets}
NOT_MOVES = {(a, b) for a, b in itertools.permutations(RS, 2) if (a, b) not in MOVES}


def state(status: RunnerStatus) -> RunnerState:
    return RunnerState(id="m@h", host="h", model="m", status=status)


def test_every_status_has_its_moves_and_is_reached_from_a_spawn() -> None:
    assert set(RUNNER_TRANSITIONS) == set(RS)
    assert reachable(RUNNER_TRANSITIONS, lifecycle.RUNNER_BORN) == set(RS)


def test_an_ended_runner_comes_back_only_by_a_new_spawn() -> None:
    assert RS.SHUTDOWN in RUNNER_ENDINGS and RS.FAILED in RUNNER_ENDINGS
    for ending in RUNNER_ENDINGS:
        assert RUNNER_TRANSITIONS[ending] <= RUNNER_ENDINGS, ending
    # Final statuses (is_final) are endings; a spawn starts over from the beginning.
    assert {s for s in RS if s.is_final} <= RUNNER_ENDINGS
    assert lifecycle.spawned_runner("m@h", "h", "m").status == RS.WAITING_FOR_MODEL


def test_the_lifecycle_of_a_runner_that_loads_serves_and_stops() -> None:
    path = [RS.LOADING, RS.LOADED, RS.WARMING_UP, RS.READY, RS.RUNNING, RS.READY]
    path += [RS.SHUTTING_DOWN, RS.SHUTDOWN]
    current: RunnerState | None = lifecycle.spawned_runner("m@h", "h", "m")
    for to in path:
        assert current is not None
        current = lifecycle.move_runner(current, to, active_jobs=1)
        assert current is not None and current.status == to and current.active_jobs == 1


@pytest.mark.parametrize("status", list(RS))
def test_any_live_runner_may_fail_and_republishing_its_status_is_no_move(
    status: RunnerStatus,
) -> None:
    if status not in RUNNER_ENDINGS:
        assert RS.FAILED in RUNNER_TRANSITIONS[status]
    again = lifecycle.move_runner(state(status), status, error="why")
    assert again is not None and again.status == status and again.error == "why"


@pytest.mark.parametrize(("frm", "to"), sorted(NOT_MOVES))
def test_each_move_the_table_lacks_is_refused_and_logged(
    frm: RunnerStatus, to: RunnerStatus, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="exo_tasks.lifecycle"):
        assert lifecycle.move_runner(state(frm), to) is None
        assert not lifecycle.may_move_runner(frm, to)
    assert [r.message for r in caplog.records] == ["runner status change refused"]
    assert (caplog.records[0].__dict__["status"], caplog.records[0].__dict__["to"]) == (frm, to)


def test_the_refusals_include_the_rules_that_matter() -> None:
    # A runner serves only once warmed up, and a stopped one serves again only after a spawn.
    for frm, to in [
        (RS.LOADING, RS.READY),
        (RS.WAITING_FOR_MODEL, RS.READY),
        (RS.SHUTDOWN, RS.READY),
        (RS.FAILED, RS.RUNNING),
        (RS.UNLOADED, RS.READY),
        (RS.SHUTTING_DOWN, RS.READY),
    ]:
        assert (frm, to) in NOT_MOVES
