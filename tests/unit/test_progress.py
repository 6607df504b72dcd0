"""A running job's progress, from its event stream (exo_tasks.progress): pure."""

from __future__ import annotations

from datetime import timedelta

from exo_tasks.progress import entry_time, with_progress
from exo_tasks.types import JobEvent, JobStatus, RequeuedEvent, TokenEvent, utcnow
from tests.unit.fakes import new_job


def test_progress_counts_tokens_not_text_events() -> None:
    started = utcnow()
    job = new_job(status=JobStatus.RUNNING, started_at=started)
    # Tokens 3 and 4 had no text (held back as a possible stop string): no event of theirs.
    events: list[tuple[str, JobEvent]] = [
        (f"{int(started.timestamp() * 1000) + i}-0", TokenEvent(index=i, text="a", tokens=n))
        for i, n in enumerate([1, 2, 5])
    ]
    now = started + timedelta(seconds=1)
    progress = with_progress(job, events, now)
    assert progress.usage.completion_tokens == 5 and progress.output.text == "aaa"
    assert progress.first_token_at == entry_time(events[0][0])
    assert progress.timings.ttft_ms is not None

    # A requeue starts the count again.
    requeued = [
        *events,
        ("9-0", RequeuedEvent(attempt=2)),
        ("10-0", TokenEvent(index=0, text="b", tokens=1)),
    ]
    again = with_progress(job, requeued, now)
    assert again.usage.completion_tokens == 1 and again.first_token_at == entry_time("10-0")
