"""A running job's progress, from its event stream: tokens, text and timings so far.

The runner writes a job's record at its start and end only; in between its tokens go to the
job's event stream (one entry per step with text, see store.jobs.write_step). A reader of the
job resource reads that stream, so progress costs the runner no write per token. Pure: the
caller reads the events.
"""

from __future__ import annotations

from datetime import UTC, datetime

from exo_tasks.types import (
    JobEvent,
    JobOutput,
    JobRecord,
    JobStatus,
    RequeuedEvent,
    Timings,
    TokenEvent,
    Usage,
    milliseconds,
)


def entry_time(entry_id: str) -> datetime:
    """When Redis appended a stream entry: its id starts with the milliseconds."""
    return datetime.fromtimestamp(int(entry_id.partition("-")[0]) / 1000, tz=UTC)


def with_progress(job: JobRecord, events: list[tuple[str, JobEvent]], now: datetime) -> JobRecord:
    """A running job with `usage.completion_tokens`, `output.text`, `first_token_at` and
    `timings` (queue, TTFT, tokens/s) of its current attempt so far; any other job as it is.
    Counted as the finished job's are (JobRecord.ended), except that the first token's time is
    its stream entry's."""
    if job.status != JobStatus.RUNNING:
        return job
    texts: list[str] = []
    first_at: datetime | None = None
    tokens = 0
    for entry_id, event in events:
        if isinstance(event, RequeuedEvent):  # an earlier attempt's text is discarded
            texts, first_at, tokens = [], None, 0
        elif isinstance(event, TokenEvent):
            texts.append(event.text)
            first_at = first_at or entry_time(entry_id)
            tokens = max(event.tokens, len(texts))  # tokens, not events (older: events)
    timings = Timings()
    if job.started_at is not None:
        timings.queue_ms = milliseconds(job.started_at - job.created_at)
        if first_at is not None:
            timings.ttft_ms = max(0.0, milliseconds(first_at - job.started_at))
            decode_s = (now - first_at).total_seconds()
            if tokens > 1 and decode_s > 0:
                timings.tokens_per_s = round((tokens - 1) / decode_s, 2)
    prompt_tokens = job.usage.prompt_tokens
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=tokens, total_tokens=prompt_tokens + tokens
    )
    output = JobOutput(text="".join(texts))
    so_far = {"output": output, "usage": usage, "timings": timings, "first_token_at": first_at}
    return job.model_copy(update=so_far)
