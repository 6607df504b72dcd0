"""Long prompts prefilled in a process of their own, beside the runner's decoding batch
(EXO_PREFILL_PROCESS_MIN_TOKENS, on the CPU).

On the CPU a prompt token late in a long prompt costs more than a decode step: with the `bench`
model on 2 cores, one forward pass of a single token at position 6,900 takes 186 ms (attention
over the cache) against 147 ms for a decode step of 4 jobs, so however a lane's steps share
their time between decoding and prefill (`exo_tasks.runner.prefill_pace`), a decoding job waits
more than twice its usual gap behind a 7,000-token prompt, or the prompt crawls. Two threads of
one process are no way out either: a thread decoding beside another prefilling slowed to
1.6-1.9 s a step (MLX, measured), where two processes ran as fast side by side as alone (a
decode step 164 ms against 162, prefill 62.7 tokens/s against 63.3). So a prompt whose part to
compute is long enough goes to this process, which holds a copy of the model (its memory, once
more), computes the whole prompt and hands back its KV state and the logits at its last token
through files. The runner samples the job's first token from those logits as the job's lane
would; a job that token does not end joins its lane from there, as from a cached prefix. So a
lane never computes a long prompt's last token (one forward pass over the whole prompt's cache,
the step every decoding job of the lane waits for), and a one-token job never joins a lane.
While the process computes, the lanes step one fewer at a time (`BatchEngine`): it keeps a core
busy as a lane does.

The process starts with the first prompt long enough for it, not with the runner: a runner
that never sees one (most, and every one of the test suite's) costs no second copy, and one
that does pays the load once, beside its lanes (the prompt waits in the process's queue; the
`bench` model loads in about a second, a 7,000-token prompt takes minutes). It starts only
where the host's available memory holds the model ROOM_FACTOR times over: the copy never takes
the memory the host has least of, and without room the lanes prefill every prompt.

Nothing is lost on the way: a prompt the process could not do (it failed, did not load within
LOAD_TIMEOUT_S, or is gone) is prefilled by its lane as before. The process reads its requests
on stdin; when the runner exits, however it exits, stdin ends and so does the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Literal

import psutil
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

if TYPE_CHECKING:
    from exo_tasks.runner.first_token import First
    from exo_tasks.runner.lane import LaneJob

log = logging.getLogger("exo_tasks.runner.prefiller")
# How long the runner's step waits for the process when it has nothing else to do.
IDLE_WAIT_S = 0.2
CLOSE_WAIT_S = 5.0
# The process starts where the host's available memory is at least this many model copies.
ROOM_FACTOR = 2
# Loading counts as the prompts' progress for the runner's stall watchdog, this long at most.
LOAD_TIMEOUT_S = 60.0


class Ready(BaseModel):
    kind: Literal["ready"] = "ready"  # the model is loaded


class Prefill(BaseModel):
    kind: Literal["prefill"] = "prefill"
    job_id: str
    tokens: list[int]  # the whole prompt


class Cancel(BaseModel):
    kind: Literal["cancel"] = "cancel"
    job_id: str


class Progress(BaseModel):
    kind: Literal["progress"] = "progress"  # a chunk computed
    job_id: str


class Done(BaseModel):
    kind: Literal["done"] = "done"
    job_id: str
    path: str  # the prompt's KV state, mlx-lm's prompt cache file
    logits_path: str  # the logits at its last token (what its first token is sampled from)

    def remove(self) -> None:
        for path in (self.path, self.logits_path):
            Path(path).unlink(missing_ok=True)


class Failed(BaseModel):
    kind: Literal["failed"] = "failed"
    job_id: str
    error: str


Request = Annotated[Prefill | Cancel, Field(discriminator="kind")]
Reply = Annotated[Ready | Progress | Done | Failed, Field(discriminator="kind")]
_requests: TypeAdapter[Prefill | Cancel] = TypeAdapter(Request)
_replies: TypeAdapter[Ready | Progress | Done | Failed] = TypeAdapter(Reply)


class Prefiller:
    """The runner's side: the process (once started), the jobs it holds, what it has sent
    back. `copy_bytes`: the model's weights, what the process's copy of them takes."""

    def __init__(self, model_path: str, min_tokens: int, step_size: int, copy_bytes: int) -> None:
        self.min_tokens = min_tokens
        self.copy_bytes = copy_bytes
        self._model_path = model_path
        self._step_size = step_size
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._replies: queue.SimpleQueue[Ready | Progress | Done | Failed | None] = (
            queue.SimpleQueue()
        )
        self._jobs: dict[str, LaneJob] = {}  # by id, while the process has them
        self._alive = True  # False once it is gone, or can never start
        self._ready = False
        self._load_deadline = 0.0
        self._chunks = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def computing(self) -> bool:
        """Whether the process holds a prompt: it keeps one core busy until it hands it back."""
        return bool(self._jobs)

    def start(self) -> bool:
        """Start the process, unless it runs already; False if it is gone or cannot start
        (the host's available memory holds fewer than ROOM_FACTOR copies of the model)."""
        if self._process is not None or not self._alive:
            return self._alive
        available = psutil.virtual_memory().available
        if available < ROOM_FACTOR * self.copy_bytes:
            self._alive = False
            log.warning(
                "no room for the prefill process's copy of the model; lanes prefill every prompt",
                extra={"available_mib": available >> 20, "model_mib": self.copy_bytes >> 20},
            )
            return False
        # Files in RAM where there is a RAM file system: a 7,000-token state is ~60 MB.
        ram = "/dev/shm" if Path("/dev/shm").is_dir() else None
        try:
            self._dir = Path(tempfile.mkdtemp(prefix="exo-prefill-", dir=ram))
            command = [sys.executable, "-m", __name__, self._model_path, str(self._dir)]
            command.append(str(self._step_size))
            self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        except OSError:
            self._alive = False
            log.exception("the prefill process could not start; lanes prefill every prompt")
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            return False
        self._load_deadline = time.monotonic() + LOAD_TIMEOUT_S
        assert self._process.stdout is not None
        threading.Thread(
            target=_read_replies, args=(self._process.stdout, self._replies), daemon=True
        ).start()
        log.info("prefill process started", extra={"pid": self._process.pid})
        return True

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the started process has loaded the model (False: it could not, or not
        in time)."""
        deadline = time.monotonic() + timeout_s
        while (
            self._process is not None
            and not self._ready
            and self._alive
            and (left := deadline - time.monotonic()) > 0
        ):
            with contextlib.suppress(queue.Empty):
                self._settle(self._replies.get(timeout=left))
        return self._ready

    def takes(self, job: LaneJob, rest: list[int]) -> bool:
        """Take `job` if the part of its prompt left to compute is long enough."""
        if len(rest) < self.min_tokens or not self.start():
            return False
        if not self._send(Prefill(job_id=job.job_id, tokens=job.prompt)):
            return False
        self._jobs[job.job_id] = job
        log.info("prompt sent to the prefill process", extra={"job_id": job.job_id})
        return True

    def cancel(self, job_id: str) -> None:
        if self._jobs.pop(job_id, None) is not None:
            self._send(Cancel(job_id=job_id))

    def take_chunks(self) -> int:
        """Chunks computed since the last call: progress for the runner's stall watchdog (a
        load under way counts as one)."""
        chunks, self._chunks = self._chunks, 0
        return chunks + (1 if self._loading() else 0)

    def _loading(self) -> bool:
        """Whether the process is loading the model for the prompts it holds; one that has not
        loaded within LOAD_TIMEOUT_S is killed (its prompts go back to their lanes)."""
        if self._process is None or self._ready or not self._alive or not self._jobs:
            return False
        if time.monotonic() < self._load_deadline:
            return True
        log.error("the prefill process did not load the model in time; killed")
        self._alive = False  # no more prompts for it; its reader hands back the ones it holds
        self._process.kill()
        return False

    def finished(self, *, idle: bool) -> list[tuple[LaneJob, Done | None]]:
        """The jobs the process is done with, each with its files (None: the lane prefills
        it); `idle`: the engine has nothing else to do, so wait a moment for one rather than
        spin."""
        done: list[tuple[LaneJob, Done | None]] = []
        wait_s = IDLE_WAIT_S if idle and self._jobs else 0.0
        with contextlib.suppress(queue.Empty):
            reply = self._replies.get(timeout=wait_s) if wait_s else self._replies.get_nowait()
            while True:
                done += self._settle(reply)
                reply = self._replies.get_nowait()
        return done

    def _settle(
        self, reply: Ready | Progress | Done | Failed | None
    ) -> list[tuple[LaneJob, Done | None]]:
        if reply is None:  # the process is gone: the lanes prefill its prompts
            if self._alive:
                log.error("the prefill process exited; lanes prefill its prompts")
            self._alive = False
            jobs, self._jobs = list(self._jobs.values()), {}
            return [(job, None) for job in jobs]
        if isinstance(reply, Ready):
            self._ready = True
            return []
        if isinstance(reply, Progress):
            self._chunks += 1
            return []
        job = self._jobs.pop(reply.job_id, None)
        done = reply if isinstance(reply, Done) else None
        if isinstance(reply, Failed):
            log.error(
                "the prefill process failed a prompt; its lane prefills it",
                extra={"job_id": reply.job_id, "error": reply.error},
            )
        if job is None:  # cancelled meanwhile
            if done is not None:
                done.remove()
            return []
        return [(job, done)]

    def _send(self, request: Prefill | Cancel) -> bool:
        assert self._process is not None
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(request.model_dump_json().encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, ValueError):  # gone; its reader says so to `finished`
            self._alive = False
            return False
        return True

    @staticmethod
    def first_token(done: Done, job: LaneJob) -> First | None:
        """The job's first token, sampled from the process's logits as its lane would, and the
        job set to go on from the process's KV state as from a cached prefix (None: the files
        were unreadable, the lane prefills the prompt); the files are removed. Call it on the
        lane's thread (an MLX stream is its thread's)."""
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache

        try:
            cache = load_prompt_cache(done.path)  # type: ignore[no-untyped-call]
            logits = mx.load(done.logits_path)
            assert isinstance(logits, mx.array)
            mx.eval([c.state for c in cache], logits)
        except Exception:
            log.exception("a prefilled state was unreadable", extra={"job_id": job.job_id})
            return None
        finally:
            done.remove()
        from exo_tasks.runner.first_token import begin

        return begin(job, logits, cache)

    def close(self) -> None:
        """Stop the process (its stdin ends: it exits) and remove its files."""
        if self._process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        assert self._dir is not None
        shutil.rmtree(self._dir, ignore_errors=True)


def _read_replies(stdout: IO[bytes], replies: queue.SimpleQueue[Any]) -> None:
    for line in stdout:
        try:
            replies.put(_replies.validate_json(line))
        except ValidationError:  # not ours (a library's print): the replies go on
            log.warning(
                "the prefill process wrote a line that is no reply", extra={"line": line[:200]}
            )
    replies.put(None)


# --- the process ---


def serve(model_path: str, directory: Path, step_size: int) -> None:
    """Prefill each prompt asked for, in order, a chunk of `step_size` tokens at a time; hand
    back its KV state and the logits at its last token."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else prints goes to the log, not into the replies
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    requests: queue.SimpleQueue[Prefill] = queue.SimpleQueue()
    cancelled: set[str] = set()
    threading.Thread(target=_read_requests, args=(requests, cancelled), daemon=True).start()

    def reply(message: Ready | Progress | Done | Failed) -> None:
        replies.write(message.model_dump_json().encode() + b"\n")
        replies.flush()

    model = mlx_lm.load(model_path)[0]
    reply(Ready())

    while True:
        request = requests.get()
        job_id, tokens = request.job_id, request.tokens
        try:
            cache = make_prompt_cache(model)
            done, output = 0, None
            while done < len(tokens) and job_id not in cancelled:
                chunk = tokens[done : done + step_size]
                output = model(mx.array(chunk)[None], cache=cache)
                mx.eval([c.state for c in cache])  # the cache only: no pass of the model's head
                done += len(chunk)
                reply(Progress(job_id=job_id))
            if job_id in cancelled:
                continue
            if output is None:
                raise ValueError("an empty prompt")
            name = directory / uuid.uuid4().hex
            path, logits_path = f"{name}.safetensors", f"{name}.npy"
            save_prompt_cache(path, cache)
            mx.save(logits_path, output[:, -1, :])  # the head's one pass: the last chunk's
            reply(Done(job_id=job_id, path=path, logits_path=logits_path))
        except Exception as exc:  # noqa: BLE001 (the prompt's failure: its lane tries it)
            reply(Failed(job_id=job_id, error=repr(exc)))
        finally:
            cancelled.discard(job_id)


def _read_requests(requests: queue.SimpleQueue[Prefill], cancelled: set[str]) -> None:
    for line in sys.stdin.buffer:
        request = _requests.validate_json(line)
        if isinstance(request, Cancel):
            cancelled.add(request.job_id)
        else:
            requests.put(request)
    os._exit(0)  # the runner is gone (or closed us): now, even mid-chunk


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
