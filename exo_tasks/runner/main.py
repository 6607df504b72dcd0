"""The entry point of a spawned runner process: its own process group, logs that name it, an
exit when the worker dies, signals, then the batching loop until it stops (or, for a rank of an
instance other than 0, the loop that follows rank 0)."""

from __future__ import annotations

import faulthandler
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Any, NoReturn

from exo_tasks.logs import configure_logging
from exo_tasks.process_exit import exit_now
from exo_tasks.runner.process import STACKS_SIGNAL, RunnerProgress, RunnerSpec
from exo_tasks.store import Store

log = logging.getLogger("exo_tasks.runner")
# Exit code of a runner that exits because its worker died.
EXIT_ORPHANED = 70
# How long an orphaned rank tries to record its instance's failure before it exits anyway.
ORPHAN_REPORT_S = 1.0


def main(spec_json: str, progress_array: Any) -> NoReturn:
    """Entry point of the spawned runner process."""
    spec = RunnerSpec.model_validate_json(spec_json)
    # Our own process group: a signal sent to the worker's group (honcho, a terminal's Ctrl-C)
    # must not reach the runner; the supervisor decides when it stops.
    os.setpgid(0, 0)
    configure_logging(spec.log_level, runner=spec.runner_id, host=spec.host)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    _exit_with_parent(spec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    progress = RunnerProgress(progress_array)
    try:
        code = _run_rank(spec, progress) if spec.rank is not None else _run_whole(spec, progress)
    except SystemExit as exc:  # SIGTERM before it serves, or with Redis gone (Runner.on_sigterm)
        code = exc.code if isinstance(exc.code, int) else 1
    # It has written all it owes (its last state, its jobs' endings; a rank 0 has closed the
    # ring): it leaves without the teardown, which took 0.3-1.3 s after "runner stopped
    # cleanly" while its worker's stop waited; the kernel closes the ring's sockets.
    exit_now(code)


def _run_whole(spec: RunnerSpec, progress: RunnerProgress) -> int:
    # Imported here: the worker imports this module to spawn the runner, and the loop's
    # modules (the tokenizer's library among them) are the runner's alone.
    from exo_tasks.runner.loop import Runner

    runner = Runner(spec, progress)
    signal.signal(signal.SIGTERM, lambda *_: runner.on_sigterm())
    return runner.run()


def _run_rank(spec: RunnerSpec, progress: RunnerProgress) -> int:
    from exo_tasks.runner.loop import Runner
    from exo_tasks.runner.rank import EXIT_PEER_LOST, Follower, load_leader
    from exo_tasks.runner.schedule import PeerLost
    from exo_tasks.runner.sigterm import Collectives, watch_sigterm

    assert spec.rank is not None
    store = Store.from_url(spec.redis_url, job_ttl_s=spec.job_ttl_s)
    if spec.rank.rank > 0:
        # A follower has nothing to finish on its own (rank 0 ends the jobs), and spends its
        # idle time blocked inside a collective, where no Python handler would run: the
        # default action ends it at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return Follower(spec, progress, store).run()
    collectives = Collectives()
    load = functools.partial(load_leader, store=store, collectives=collectives)
    runner = Runner(spec, progress, store, load)
    signal.signal(signal.SIGTERM, lambda *_: runner.on_sigterm())
    # A handler cannot run while a collective blocks the main thread: a thread watches.
    watch_sigterm(collectives)
    try:
        return runner.run()
    except PeerLost as exc:
        log.error("a peer of the ring is gone; rank 0 exits", extra={"error": str(exc)})
        return EXIT_PEER_LOST


def _exit_with_parent(spec: RunnerSpec) -> None:
    """Leave at once if the worker dies (SIGKILL included), so no model stays resident; a rank
    first records why its instance failed (its peers only see their ring break)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.error("worker process %s is gone; runner exits", parent.pid)
        if spec.rank is not None:
            cause = f"its worker (pid {parent.pid}) died"
            report = threading.Thread(target=_report_rank_failure, args=(spec, cause), daemon=True)
            report.start()
            report.join(ORPHAN_REPORT_S)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _report_rank_failure(spec: RunnerSpec, cause: str) -> None:
    from exo_tasks.runner.rank import fail_instance

    try:
        fail_instance(Store.from_url(spec.redis_url), spec, cause)
    except Exception:  # best effort: the supervisors find out anyway
        log.exception("could not record the instance's failure")
