"""The batch's state machine as data (exo_tasks.lifecycle.BATCH_TRANSITIONS), walked: every
status reachable from a new batch, an ended batch never leaving its ending, every move the table
has accepted from the status the feeder saw, and every other refused (nothing the store's
compare-and-set can match) and logged, never raised."""

from __future__ import annotations

import itertools
import logging

import pytest

from exo_tasks import lifecycle
from exo_tasks.batch_types import BATCH_ENDED, Batch, BatchStatus
from exo_tasks.lifecycle import BATCH_TRANSITIONS
from tests.unit.tables import reachable

BS = BatchStatus
MOVES = {(a, b) for a, targets in BATCH_TRANSITIONS.items() for b in targets}
NOT_MOVES = {(a, b) for a, b in itertools.product(BS, repeat=2) if (a, b) not in MOVES}


def batch(status: BatchStatus) -> Batch:
    return Batch(
        id="batch_1",
        endpoint="/v1/chat/completions",
        input_file_id="file-1",
        completion_window="24h",
        status=status,
        created_at=1,
        expires_at=2,
    )


def test_every_status_has_its_moves_and_is_reached_from_a_new_batch() -> None:
    assert set(BATCH_TRANSITIONS) == set(BS)
    assert reachable(BATCH_TRANSITIONS, BS.VALIDATING) == set(BS)


def test_an_ended_batch_never_leaves_its_ending() -> None:
    for ending in BATCH_ENDED:
        assert BATCH_TRANSITIONS[ending] == {ending}, ending
    for status in set(BS) - BATCH_ENDED:
        assert BS.FAILED in BATCH_TRANSITIONS[status], status


@pytest.mark.parametrize(("current", "to"), sorted(MOVES))
def test_every_move_in_the_table_is_accepted_from_the_status_seen(
    current: BatchStatus, to: BatchStatus
) -> None:
    move = lifecycle.move_batch(batch(current), to, 7, metadata={"k": "v"})
    assert move.allowed_from == (current,)
    assert move.batch.status == to and getattr(move.batch, f"{to}_at") == 7
    assert move.batch.metadata == {"k": "v"}


@pytest.mark.parametrize(("current", "to"), sorted(NOT_MOVES))
def test_every_other_move_is_refused_and_logged(
    current: BatchStatus, to: BatchStatus, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="exo_tasks.lifecycle"):
        move = lifecycle.move_batch(batch(current), to, 7)
    assert move.allowed_from == ()
    assert [r.getMessage() for r in caplog.records] == ["batch status change refused"]


def test_the_apis_cancel_matches_any_status_the_table_cancels_from() -> None:
    expected = tuple(s for s in BS if BS.CANCELLING in BATCH_TRANSITIONS[s])
    assert expected == (BS.VALIDATING, BS.IN_PROGRESS)
    for status in expected:
        move = lifecycle.cancel_batch(batch(status), 9)
        assert move.allowed_from == expected
        assert move.batch.status == BS.CANCELLING and move.batch.cancelling_at == 9
