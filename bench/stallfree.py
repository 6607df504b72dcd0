"""Stall-free decode (issue 32) on the `bench` model: STREAMS streams decode while PROMPTS long
prompts (config.stall_prompt_tokens each, distinct) arrive at once, on exo_tasks and on
mlx_lm.server. Rows: each stream's p99 gap between tokens (the median over the streams) with
the long prompts arriving and without them, and the long prompts' TTFT (p50) beside the streams
and alone. The streams are long enough to outlast the prompts' prefill (their length is taken
from the prompts' TTFT alone); gaps are counted from when the prompts are sent until the last
one's first token, and there the streams end (cancelled on exo_tasks, disconnected from
mlx_lm.server). A stream's gaps grow with its own cache, so the gaps without the prompts are
measured twice: a short probe's, and the same streams' alone over the same positions (as many
tokens as they decoded beside the prompts).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

from bench.clients import Client, CompletionsClient, ExoClient, Trace
from bench.config import Config
from bench.contenders import Lab, start_exo, start_mlx_server
from bench.prompts import text_of
from bench.results import EXO, MLX_SERVER, Results, Target, percentile
from tests.support.processes import Processes

log = logging.getLogger("bench")
SECTION = "stall_free"
STREAMS, PROMPTS = 8, 4
# exo_tasks without its prefill process (EXO_PREFILL_PROCESS_MIN_TOKENS=0): the lanes' paced
# steps prefill every prompt between decode steps.
EXO_LANES_ONLY = "exo_tasks, lanes only"
PROBE_TOKENS = 32  # a stream's length while its pace is measured, without the long prompts
SAME_LENGTHS = "stream p99 gap, without the long prompts, at the same lengths"
# mlx_lm.server sends a completion nothing before its first token: on the full workload the four
# prompts alone took over 5 minutes to a first token, beside the streams longer (a default read
# timeout, 300 s, failed them).
PREFILL_SILENCE_S = 3600.0


def run(lab: Lab, config: Config, results: Results) -> None:
    tokenizer = Tokenizer.from_file(str(config.bench_model / "tokenizer.json"))
    # Distinct prompts alone and beside the streams: the second set must not find the first in
    # a prompt cache.
    prompts = {
        phase: [
            text_of(tokenizer, config.stall_prompt_tokens, f"{phase} {i}:") for i in range(PROMPTS)
        ]
        for phase in ("Alone", "Beside")
    }
    for contender in (EXO, EXO_LANES_ONLY, MLX_SERVER):
        log.info("stall-free decode: %s", contender)
        client, processes = _start(lab, config, contender)
        try:
            _measure(client, prompts, contender, results)
        finally:
            lab.stop(processes)


def _start(lab: Lab, config: Config, contender: str) -> tuple[Callable[[], Client], Processes]:
    if contender == MLX_SERVER:
        server = start_mlx_server(lab, "mlx-stall", config.bench_model)
        return lambda: CompletionsClient(server.url, PREFILL_SILENCE_S), server.processes
    # Without jobs decoding, a step prefills 256 tokens: on a loaded machine one such step of a
    # 7,000-token prompt's end can near the 60 s stall limit, which guards against hangs only.
    # The prompts alone share one lane, one after another: ~215 s each on a quiet 2-core
    # machine, so the last one's first token comes after the default job limit (600 s).
    stack = start_exo(
        lab,
        "exo-stall" if contender == EXO else "exo-stall-lanes",
        config.bench_model,
        prefill_timeout_s=600.0,
        job_soft_time_limit_s=3000.0,  # below the broker's visibility timeout (1 h)
        # The streams outlast the prompts' prefill beside them: ~8,500 tokens each when the
        # four prompts alone took 15 min (EXO_MAX_TOKENS is 4,096 by default).
        max_tokens=32_768,
        **({"prefill_process_min_tokens": 0} if contender == EXO_LANES_ONLY else {}),
    )
    return lambda: ExoClient(stack.url, ignore_eos=True), stack.processes


def _measure(
    client: Callable[[], Client], prompts: dict[str, list[str]], contender: str, results: Results
) -> None:
    alone = _together(client, [(p, 1) for p in prompts["Alone"]])
    _refuse_failed(alone, contender)
    ttft_alone = [t.ttft_s or 0.0 for t in alone]
    probes = _together(
        client, [(f"Stream {i}: tell a story", PROBE_TOKENS) for i in range(STREAMS)]
    )
    per_token_s = max(_median_gap(t) for t in probes)
    # Long enough to decode until the prompts' prefill is over, beside them (where each of
    # their steps may take twice as long as alone).
    stream_tokens = int(1.5 * max(ttft_alone) / per_token_s) + PROBE_TOKENS
    log.info("stall-free %s: TTFT alone %s s, streams of %d", contender, ttft_alone, stream_tokens)
    streams = [Trace(time.monotonic()) for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=client().run, args=(t, f"Stream {i}: go on", stream_tokens))
        for i, t in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    while min(len(t.token_times) for t in streams) < 3:
        _refuse_failed(streams, contender)
        time.sleep(0.05)
    sent = time.monotonic()
    beside = _together(client, [(p, 1) for p in prompts["Beside"]])
    until = max((t.token_times[0] for t in beside if t.token_times), default=time.monotonic())
    for trace in streams:  # their gaps are counted up to here; decoding on costs the run time
        trace.stop.set()
    for thread in threads:
        thread.join()
    sample = results.sample
    for label, traces, start, end in (
        ("without", probes, 0.0, 1e18),
        ("with", streams, sent, until),
    ):
        p99s = [percentile(_gaps(t, start, end), 99) * 1000 for t in traces]
        sample(
            SECTION,
            f"stream p99 gap, {label} the long prompts",
            contender,
            "ms",
            percentile(p99s, 50),
        )
    # The same streams alone, over the positions they decoded at beside the prompts.
    first = min(sum(1 for t in trace.token_times if t < sent) for trace in streams)
    reached = min(sum(1 for t in trace.token_times if t <= until) for trace in streams)
    alike = _together(client, [(f"Stream {i}: go on", reached) for i in range(STREAMS)])
    _refuse_failed(alike, contender)
    p99s = [percentile(_gaps_at(t, first, reached), 99) * 1000 for t in alike]
    sample(SECTION, SAME_LENGTHS, contender, "ms", percentile(p99s, 50))
    sample(SECTION, "long prompts TTFT p50, alone", contender, "s", percentile(ttft_alone, 50))
    ttft_beside = [t.ttft_s or 0.0 for t in beside]
    sample(
        SECTION,
        "long prompts TTFT p50, beside the streams",
        contender,
        "s",
        percentile(ttft_beside, 50),
    )
    log.info(
        "stall-free %s: p99 gaps %s ms without, %s ms with; TTFT beside %s s",
        contender,
        [round(percentile(_gaps(t, 0.0, 1e18), 99) * 1000) for t in probes],
        [round(percentile(_gaps(t, sent, until), 99) * 1000) for t in streams],
        ttft_beside,
    )
    failed = [t.error for t in (*alone, *probes, *streams, *beside) if t.error]
    if failed:
        log.error("stall-free %s: %d requests failed: %s", contender, len(failed), failed[0])


def _refuse_failed(traces: list[Trace], contender: str) -> None:
    """The section's figures need every request: a failed one ends it, saying why."""
    if failed := [t.error for t in traces if t.error]:
        raise RuntimeError(f"stall-free {contender}: {len(failed)} requests failed: {failed[0]}")


def _together(client: Callable[[], Client], requests: list[tuple[str, int]]) -> list[Trace]:
    def one(request: tuple[str, int]) -> Trace:
        trace = Trace(time.monotonic())
        client().run(trace, *request)
        return trace

    pool = ThreadPoolExecutor(len(requests))
    try:
        return list(pool.map(one, requests))
    finally:
        # Not waiting on a Ctrl-C or SIGTERM: a long prompt's request runs for minutes; the
        # bench's stop of the stack ends it.
        pool.shutdown(wait=False, cancel_futures=True)


def _gaps(trace: Trace, start: float, end: float) -> list[float]:
    times = trace.token_times
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end] or [0.0]


def _gaps_at(trace: Trace, first: int, last: int) -> list[float]:
    """The gaps before each token from index `first` up to `last` (not included)."""
    times = trace.token_times[max(first - 1, 0) : last]
    return [b - a for a, b in itertools.pairwise(times)] or [0.0]


def _median_gap(trace: Trace) -> float:
    return percentile(_gaps(trace, 0.0, 1e18), 50)


def set_targets(results: Results) -> None:
    """Issue 32, for exo_tasks (at its defaults, and its lanes alone): the streams' p99 gap with
    the long prompts <= 2x without (a probe's, and the same streams' at the same lengths); the
    long prompts' TTFT beside the streams <= 1.3x alone."""
    pairs = (
        ("stream p99 gap, with the long prompts", "stream p99 gap, without the long prompts", 2.0),
        ("stream p99 gap, with the long prompts", SAME_LENGTHS, 2.0),
        ("long prompts TTFT p50, beside the streams", "long prompts TTFT p50, alone", 1.3),
    )
    for (row, reference_row, bound), contender in itertools.product(pairs, (EXO, EXO_LANES_ONLY)):
        measured, reference = (
            results.find(SECTION, row, contender),
            results.find(SECTION, reference_row, contender),
        )
        if (
            measured is not None
            and reference is not None
            and measured.samples
            and reference.samples
        ):
            name = f"{contender}: {row} <= {bound}x {reference_row.split(', ', 1)[1]}"
            results.targets.append(Target(name, measured, reference, "<=", bound))
