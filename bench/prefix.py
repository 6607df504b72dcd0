"""Prompt reuse on the `bench` model, exo_tasks with its prompt cache on and off against
mlx_lm.server with its own: (a) a shared system prompt, 8 and 32 clients, each job a 400-token
system prompt shared by all plus a distinct 20-token user turn, 64 tokens out; (b) multi-turn,
8 conversations of 4 turns, each turn resending the history (B_RUNS runs: medians); and (b)
again on two workers (one lane each), exo_tasks's prefix routing on and off. Rows: TTFT p50,
throughput, the share of prompt tokens served from a cache (as each server reports it in
`usage`) and the memory (RSS) of the processes that hold the model, at the end.

Both servers are greedy on the same model, so both generate the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import requests
from tokenizers import Tokenizer

from bench.chat_client import ChatClient, ChatTrace
from bench.config import Config
from bench.contenders import Lab, start_exo, start_mlx_server
from bench.prompts import text_of
from bench.results import (
    EXO,
    EXO_NO_CACHE,
    EXO_TWO_WORKERS,
    EXO_TWO_WORKERS_UNROUTED,
    MLX_SERVER,
    Op,
    Results,
    Target,
    percentile,
)
from tests.support.processes import Processes

log = logging.getLogger("bench")
SECTION = "prefix_cache"
CONTENDERS = (EXO, EXO_NO_CACHE, MLX_SERVER)
SYSTEM_TOKENS, USER_TOKENS, MAX_TOKENS = 400, 20, 64
TURNS, CONVERSATIONS = 4, 8
# (b) is four lock-step rounds: one run's tokens/s varies by up to 10% (quiet machine, 2 cores),
# as much as the margin the targets ask for. Its targets take the median of this many runs,
# the contenders taking turns; the cache off is measured once (no target on (b)).
B_RUNS = 3
Messages = list[dict[str, str]]


def run(lab: Lab, config: Config, results: Results) -> None:
    tokenizer = Tokenizer.from_file(str(config.bench_model / "tokenizer.json"))
    system = text_of(tokenizer, SYSTEM_TOKENS, "System:")
    for contender in CONTENDERS:
        for clients, per_client in ((8, 2), (32, 1)):
            log.info("prefix cache (a): %s, %d clients", contender, clients)
            jobs = [
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text_of(tokenizer, USER_TOKENS, f"Q{c}.{r}:")},
                ]
                for c in range(clients)
                for r in range(per_client)
            ]
            _measure(lab, config, results, contender, f"(a) {clients} clients", clients, jobs)
    for attempt in range(B_RUNS):
        for contender in CONTENDERS if attempt == 0 else (EXO, MLX_SERVER):
            log.info("prefix cache (b), run %d of %d: %s", attempt + 1, B_RUNS, contender)
            _measure(lab, config, results, contender, "(b) 8 conversations", CONVERSATIONS, None)
    for contender in (EXO_TWO_WORKERS, EXO_TWO_WORKERS_UNROUTED):
        log.info("prefix cache (b), two workers: %s", contender)
        level = "(b) 8 conversations, 2 workers"
        _measure(lab, config, results, contender, level, CONVERSATIONS, None)


def _measure(
    lab: Lab,
    config: Config,
    results: Results,
    contender: str,
    level: str,
    clients: int,
    jobs: list[Messages] | None,
) -> None:
    """One scenario on a freshly started contender: `jobs` shared out to `clients` clients,
    or (None) `clients` conversations of TURNS turns."""
    url, pids_of, processes = _start(lab, config.bench_model, contender)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            if jobs is None:
                batches = list(pool.map(lambda c: _conversation(url, c), range(clients)))
            else:
                batches = list(pool.map(lambda c: _send(url, jobs[c::clients]), range(clients)))
        elapsed = time.monotonic() - started
        traces = [t for batch in batches for t in batch]
        _record(results, contender, level, traces, elapsed, pids_of())
    finally:
        lab.stop(processes)


def _start(lab: Lab, model: Path, contender: str) -> tuple[str, Callable[[], list[int]], Processes]:
    """A contender's URL, the pids of the processes holding the model, and its processes."""
    if contender == MLX_SERVER:
        server = start_mlx_server(lab, "mlx-prefix", model)
        return server.url, lambda: [server.processes.started[0].pid], server.processes
    # Without the cache, 8 prompts of 420 tokens prefill side by side: on a loaded 2-core
    # machine one step of them took over the 60 s prefill stall limit, and the runner was
    # stopped as hung. The limit guards against hangs, not slow steps: raised for this section.
    settings: dict[str, Any] = {"prefill_timeout_s": 600.0}
    if contender == EXO_NO_CACHE:
        settings["prompt_cache_bytes"] = 0
    workers = 2 if contender in (EXO_TWO_WORKERS, EXO_TWO_WORKERS_UNROUTED) else 1
    if workers == 2:
        settings["runner_lanes"] = 1  # two runners on the machine's cores, not four lanes
    if contender == EXO_TWO_WORKERS_UNROUTED:
        settings["prefix_routing_ttl_s"] = 0
    stack = start_exo(lab, "exo-prefix", model, workers=workers, **settings)

    def runner_pids() -> list[int]:
        runners = requests.get(f"{stack.url}/v1/runners", timeout=10).json()
        return [int(runner["pid"]) for runner in runners]

    return stack.url, runner_pids, stack.processes


def _send(url: str, jobs: list[Messages]) -> list[ChatTrace]:
    client, traces = ChatClient(url), []
    for messages in jobs:
        trace = ChatTrace(time.monotonic())
        client.run(trace, messages, MAX_TOKENS)
        traces.append(trace)
    return traces


def _conversation(url: str, index: int) -> list[ChatTrace]:
    client, traces = ChatClient(url), []
    messages: Messages = [{"role": "system", "content": f"Conversation {index}. Be helpful."}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn} of talk {index}: tell me more."})
        trace = ChatTrace(time.monotonic())
        client.run(trace, messages, MAX_TOKENS)
        traces.append(trace)
        messages.append({"role": "assistant", "content": trace.text})
    return traces


def _record(
    results: Results,
    contender: str,
    level: str,
    traces: list[ChatTrace],
    elapsed: float,
    pids: list[int],
) -> None:
    done = [t for t in traces if t.error is None and t.ttft_s is not None]
    if not done:
        log.error("prefix cache %s %s: every request failed: %s", contender, level, traces[0].error)
        return
    ttfts = [(t.ttft_s or 0.0) * 1000 for t in done]
    tokens = sum(t.completion_tokens or 0 for t in done)
    sample = results.sample
    sample(SECTION, f"TTFT p50, {level}", contender, "ms", percentile(ttfts, 50))
    sample(SECTION, f"tokens/s, {level}", contender, "tokens/s", tokens / elapsed)
    sample(SECTION, f"cache hit rate, {level}", contender, "%", _hit_rate(done))
    with contextlib.suppress(psutil.NoSuchProcess):  # a runner restarted: no reading
        rss = sum(psutil.Process(pid).memory_info().rss for pid in pids) / 2**20
        sample(SECTION, f"runner memory, {level}", contender, "MiB", rss)
    _note_failures(results, contender, level, len(traces) - len(done))


def _note_failures(results: Results, contender: str, level: str, failed: int) -> None:
    row = results.find(SECTION, f"tokens/s, {level}", contender)
    if row is not None and failed:
        row.note = f"{failed} failed requests"


def _hit_rate(traces: list[ChatTrace]) -> float:
    """Prompt tokens served from a cache, in percent of all prompt tokens."""
    prompt = sum(t.prompt_tokens for t in traces)
    return 100 * sum(t.cached_tokens for t in traces) / max(prompt, 1)


def set_targets(results: Results) -> None:
    """The issue's targets: against mlx_lm.server on (a) and (b), against the cache off on (a)."""

    def ratio(row: str, reference: str, op: Op, bound: float, what: str) -> None:
        measured = results.find(SECTION, row, EXO)
        ref = results.find(SECTION, row, reference)
        if measured is not None and ref is not None and measured.samples and ref.samples:
            results.targets.append(Target(f"{row} {op} {what}", measured, ref, op, bound))

    for level in ("(a) 8 clients", "(a) 32 clients", "(b) 8 conversations"):
        ratio(f"TTFT p50, {level}", MLX_SERVER, "<=", 0.8, "0.8x mlx_lm.server")
        ratio(f"tokens/s, {level}", MLX_SERVER, ">=", 1.2, "1.2x mlx_lm.server")
    for level in ("(a) 8 clients", "(a) 32 clients"):
        ratio(f"TTFT p50, {level}", EXO_NO_CACHE, "<=", 1 / 3, "1/3 of the cache off")
