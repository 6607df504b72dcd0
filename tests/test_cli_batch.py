"""`exo-tasks batch ...` against the session stack: submit --wait (a progress bar on stderr,
then the output's path), list, status, results, cancel."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.batches import chat_line, jsonl
from tests.support.cli import UTC_TIME, exo_tasks, rows
from tests.support.stack import Stack


def test_submit_wait_then_list_status_and_results(stack: Stack, tmp_path: Path) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_bytes(jsonl([chat_line(f"c{i}", f"hi {i}") for i in range(5)]))
    result = exo_tasks(stack.api, "batch", "submit", str(source), "--wait")
    assert result.returncode == 0, result.stderr
    output = Path(result.stdout.strip())
    assert output == tmp_path / "requests.output.jsonl"
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(5)]
    assert "5/5 requests, 0 failed, completed" in result.stderr
    bars = [line for line in result.stderr.splitlines() if line.startswith("[")]
    assert len(bars) >= 2 and bars[-1].startswith("[" + "#" * 30 + "] 5/5")
    batch_id = result.stderr.split()[1]

    listed = rows(exo_tasks(stack.api, "batch", "list").stdout)
    assert listed[0] == ["ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"]
    row = next(r for r in listed if r[0] == batch_id)
    assert row[:5] == [batch_id, "completed", "/v1/chat/completions", "5/5", "0"]
    assert UTC_TIME.fullmatch(row[5])  # as `jobs` prints its times
    status = json.loads(exo_tasks(stack.api, "batch", "status", batch_id).stdout)
    assert status["id"] == batch_id and status["request_counts"]["completed"] == 5
    saved = tmp_path / "again.jsonl"
    results = exo_tasks(stack.api, "batch", "results", batch_id, "-o", str(saved))
    assert results.returncode == 0 and saved.read_bytes() == output.read_bytes()
    to_stdout = exo_tasks(stack.api, "batch", "results", batch_id)
    assert to_stdout.stdout == output.read_text()


def test_submit_then_cancel(stack: Stack, tmp_path: Path) -> None:
    source = tmp_path / "long.jsonl"
    lines = [chat_line(f"l{i}", "go", max_tokens=400, ignore_eos=True) for i in range(100)]
    source.write_bytes(jsonl(lines))
    submitted = exo_tasks(stack.api, "batch", "submit", str(source))
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    cancel = exo_tasks(stack.api, "batch", "cancel", batch_id)
    assert cancel.returncode == 0 and cancel.stdout.strip() == f"batch {batch_id}: cancelling"
    again = exo_tasks(stack.api, "batch", "results", "no-such-batch")
    assert again.returncode == 2 and "404" in again.stderr
