"""Decoding jobs keep streaming while a long prompt prefills (issue 32): on the CPU a step's
prefill is budgeted in time, not tokens. A real worker and runner on the `bench` preset, where
a step of 256 prompt tokens takes seconds (4.4 s on a quiet 2-core machine)."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load, stream_generate

from exo_tasks.runner.engine import PREFILL_STEP_SIZE
from exo_tasks.store import Store
from tests.support import sse
from tests.support.api import api_settings, serving
from tests.support.processes import Processes, RedisServer, wait_until
from tests.support.workers import start_worker, wait_runner_ready

HOST = {"host": "stall-free"}
# A bystander's wait for a token while the prompt prefills, but for the longest one (a loaded
# machine's hiccup), against its wait before: a step of its own decoding and about as long
# again of prefill, but at least MIN_CHUNK tokens, which cost more than their share on a loaded
# machine (13x the wait before, at a load average of 18 on 2 cores; 3x on a quiet one). A step
# of 256 prompt tokens takes over 50 decode steps of the bench model (4.4 s against 0.08 s on
# a quiet 2-core machine), and the prompt takes two.
GAP_RATIO_BOUND = 20
LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps." for i in range(20))


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exo_tasks.modelgen import create_model

    return create_model("bench", tmp_path_factory.mktemp("models") / "bench")


class Reader:
    """A job's token stream, read in a thread: when each token arrived."""

    def __init__(self, url: str, job_id: str) -> None:
        self.arrivals: list[float] = []
        reader = (url, job_id, self.arrivals)
        self.thread = threading.Thread(target=sse.time_tokens, args=reader, daemon=True)
        self.thread.start()

    def gaps(self, start: float, end: float) -> list[float]:
        """The waits for the tokens that arrived between `start` and `end`, longest first."""
        pairs = zip(self.arrivals, self.arrivals[1:], strict=False)
        return sorted((b - a for a, b in pairs if start <= b <= end), reverse=True)


@pytest.mark.timeout(600)  # a long prompt on the bench model: minutes on a loaded machine
def test_a_decoding_stream_keeps_flowing_while_a_long_prompt_prefills(
    redis_server: RedisServer, store: Store, processes: Processes, bench_model: Path, tmp_path: Path
) -> None:
    worker = start_worker(processes, redis_server.url, HOST["host"], [bench_model], tmp_path)
    # The prompt's greedy text alone, in this process while the worker loads (on the other
    # core), done before anything is timed.
    expected = alone(bench_model, LONG_PROMPT, 8)
    # The bench model loads and warms up in seconds, minutes on a loaded 2-core machine.
    wait_runner_ready(store, worker, "bench", timeout_s=300)
    with serving(api_settings(redis_server.url, [bench_model])) as api:
        bystander = api.submit(prompt="bystander", max_tokens=4000, ignore_eos=True, **HOST)
        reader = Reader(api.url, bystander)
        wait_until(lambda: len(reader.arrivals) >= 12, 120, "the bystander's first tokens")

        started = time.monotonic()
        long_job = api.wait_job(api.submit(prompt=LONG_PROMPT, max_tokens=8, **HOST), 600)
        ended = time.monotonic()
        api.post(f"/v1/jobs/{bystander}/cancel")
        reader.thread.join(60)

    prompt_tokens = long_job["usage"]["prompt_tokens"]
    assert long_job["status"] == "succeeded" and prompt_tokens > 2 * PREFILL_STEP_SIZE
    before = statistics.median(reader.gaps(0.0, started))
    gaps = reader.gaps(started, ended)
    assert gaps[1] <= GAP_RATIO_BOUND * before, f"waits for a token {gaps[:5]}, before {before}"
    # Prefilled in other chunks than alone, the prompt's greedy text is the same.
    assert long_job["output"]["text"] == expected


def alone(model_dir: Path, prompt: str, max_tokens: int) -> str:
    loaded: Any = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    tokens = tokenizer.encode(prompt)
    return "".join(r.text for r in stream_generate(model, tokenizer, tokens, max_tokens))
