"""A flood of over-long prompts (issue 27, finding 2), on the `bench` model (byte-level BPE):
FLOOD prompts of 100,000 characters (EXO_MAX_PROMPT_CHARS; about 80,000 tokens, ten times
EXO_MAX_PROMPT_TOKENS) sent at once, beside a bystander's job stream, twice:

- at the door: the real API (gunicorn's gevent workers) counts each prompt with the model's
  tokenizer and answers 422. Reported: the time to refuse them all, the API's CPU per prompt;
- past it: an API that cannot read the model's tokenizer accepts them (202) and the runner
  refuses each. Reported: the time until every job has failed.

Both: how many ended as they must (422, or `failed` naming the cap), the bystander's longest
gap between two tokens, and whether the runner was restarted (its pid).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from bench.config import Config
from bench.contenders import Lab, start_exo
from bench.results import EXO, Results
from exo_tasks.naming import runner_id_for
from exo_tasks.store import Store
from tests.support import sse
from tests.support.processes import EXO_TASKS, Processes, free_port, wait_until
from tests.support.workers import worker_env

log = logging.getLogger("bench")
SECTION = "prompt_flood"
FLOOD = 1000
SENDERS = 64
PROMPT = "the quick brown fox jumps over the lazy dog. " * 2_222
CAP = "(EXO_MAX_PROMPT_TOKENS)"


class Bystander:
    """A job's stream, read in a thread: when each token arrived."""

    def __init__(self, url: str) -> None:
        body = {"prompt": "bystander", "max_tokens": 4000, "ignore_eos": True}
        self.url = url
        self.job_id = requests.post(f"{url}/v1/jobs", json=body, timeout=30).json()["id"]
        self.arrivals: list[float] = []
        reader = (url, self.job_id, self.arrivals)
        self.thread = threading.Thread(target=sse.time_tokens, args=reader, daemon=True)
        self.thread.start()
        wait_until(lambda: len(self.arrivals) >= 3, 60, "the bystander's first tokens")

    def stop(self) -> float:
        """Cancel the job; its longest gap between two tokens."""
        requests.post(f"{self.url}/v1/jobs/{self.job_id}/cancel", timeout=30)
        self.thread.join(60)
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))


def _send(url: str) -> list[requests.Response]:
    def post(_: int) -> requests.Response:
        return requests.post(f"{url}/v1/jobs", json={"prompt": PROMPT}, timeout=600)

    with ThreadPoolExecutor(SENDERS) as pool:
        return list(pool.map(post, range(FLOOD)))


def _cpu_s(pid: int) -> float:
    tree = psutil.Process(pid)
    total = 0.0
    for proc in [tree, *tree.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def _failed_by_the_cap(store: Store, job_ids: list[str]) -> int:
    def ended() -> list[str] | None:
        jobs = [store.jobs.get(job_id) for job_id in job_ids]
        done = [j for j in jobs if j is not None and j.is_terminal]
        return [j.error or "" for j in done] if len(done) == len(job_ids) else None

    errors: list[str] = wait_until(ended, 600, "every flooded job to end", interval_s=0.5)
    return sum(CAP in error for error in errors)


def run(lab: Lab, config: Config, results: Results) -> None:
    stack = start_exo(lab, "exo-flood", config.bench_model)
    runner_id = runner_id_for(stack.model, stack.workers[0].host)
    try:
        pid = _runner_pid(stack.store, runner_id)
        api_pid = next(p.pid for p in stack.processes.started if str(p.args).endswith("'api']"))
        bystander = Bystander(stack.url)
        cpu, started = _cpu_s(api_pid), time.monotonic()
        answers = _send(stack.url)
        refused = sum(r.status_code == 422 and CAP in r.text for r in answers)
        log.info("door answers: %s", sorted({r.status_code for r in answers}))
        took_s, cpu_ms = time.monotonic() - started, (_cpu_s(api_pid) - cpu) * 1e3 / FLOOD
        _report(results, "at the door", refused, took_s, bystander.stop())
        results.sample(SECTION, "API CPU per prompt refused, at the door", EXO, "ms", cpu_ms)

        blind, blind_processes = _blind_api(lab, stack.redis.url, stack.directory, stack.model)
        bystander = Bystander(stack.url)
        started = time.monotonic()
        accepted = [r.json()["id"] for r in _send(blind) if r.status_code == 202]
        failed = _failed_by_the_cap(stack.store, accepted)
        _report(results, "at the runner", failed, time.monotonic() - started, bystander.stop())
        restarted = _runner_pid(stack.store, runner_id) != pid
        results.sample(SECTION, "runner restarted", EXO, "", float(restarted))
        lab.stop(blind_processes)
    finally:
        lab.stop(stack.processes)


def _report(results: Results, where: str, refused: int, took_s: float, gap_s: float) -> None:
    log.info("flood %s: %d/%d refused in %.1fs, gap %.2fs", where, refused, FLOOD, took_s, gap_s)
    results.sample(SECTION, f"refused with the cap named, {where}", EXO, "", refused)
    results.sample(SECTION, f"time to refuse {FLOOD}, {where}", EXO, "s", took_s)
    results.sample(SECTION, f"bystander's longest token gap, {where}", EXO, "s", gap_s)


def _runner_pid(store: Store, runner_id: str) -> int | None:
    state = store.runners.get(runner_id)
    return state.pid if state is not None else None


def _blind_api(lab: Lab, redis_url: str, directory: Path, model: str) -> tuple[str, Processes]:
    """An API serving the model by a path with no tokenizer in it: its door cannot judge."""
    processes, _ = lab.group("exo-flood")
    blind_model = directory / "blind" / model
    blind_model.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = worker_env(redis_url, "api", [blind_model], directory, api_port=port)
    processes.start([EXO_TASKS, "api"], env, directory / "blind-api.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ok(f"{url}/readyz"), 60, "the blind API")
    return url, processes


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
