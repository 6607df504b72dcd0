"""Who a client is, and the step a job waits at (exo_tasks.fairness; pure)."""

from __future__ import annotations

from config.celery import PRIORITY_CLASSES, PRIORITY_LEVELS
from exo_tasks import fairness
from exo_tasks.types import Priority

PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")


def test_a_clients_user_names_it_else_its_token_else_its_address() -> None:
    by_user = fairness.client_of("alice", "secret", "10.0.0.1")
    assert by_user == fairness.client_of("alice", None, None)
    assert by_user.label == "user 'alice'"
    by_token = fairness.client_of(None, "secret", "10.0.0.1")
    assert by_token == fairness.client_of("", "secret", "10.0.0.2")
    assert by_token.label == "this API token" and "secret" not in by_token.key
    by_address = fairness.client_of(None, None, "10.0.0.1")
    assert by_address.label == "address 10.0.0.1"
    keys = {by_user.key, by_token.key, by_address.key, fairness.batch_client("alice").key}
    assert len(keys) == 4  # a user named like a batch is not that batch
    # Any user string makes a short key, and a short label.
    long_user = fairness.client_of("u" * 256, None, None)
    assert len(long_user.key) < 64 and len(long_user.label) < 80


def test_a_job_waits_one_step_later_each_time_its_clients_waiting_jobs_double() -> None:
    assert [fairness.step_for("normal", n) for n in range(9)] == [3, 4, 5, 5, 6, 6, 6, 6, 6]
    assert [fairness.step_for("high", n) for n in range(4)] == [0, 1, 2, 2]
    assert [fairness.step_for("low", n) for n in range(4)] == [7, 8, 9, 9]
    for priority in PRIORITIES:
        steps = PRIORITY_CLASSES[priority]
        assert fairness.step_for(priority, 0) == PRIORITY_LEVELS[priority] == steps[0]
        table = fairness.step_table(priority)
        # The store's script reads the last entry for every count past the table.
        assert table[-1] == steps[-1]
        assert all(
            table[min(n, len(table) - 1)] == fairness.step_for(priority, n) for n in range(100)
        )
