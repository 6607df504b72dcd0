"""A runner's intake: its Redis inbox moved into the batching loop's local queue by a thread of
its own, so the loop never waits on the network, and each submitted job screened on the way: a
prompt over EXO_MAX_PROMPT_TOKENS for certain is refused there, so the loop never tokenizes it.

100,000 characters (EXO_MAX_PROMPT_CHARS) take 70-120 ms through mlx-lm's tokenizer, on the
loop's thread; a flood of them, refused one after another, held the batch back until the stall
watchdog killed the runner. Counted here (exo_tasks.prompt_tokens) they take 20-40 ms each,
without the GIL, beside the loop, which only writes their endings.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exo_tasks import prompt_tokens
from exo_tasks.commands import RunnerCommand, SubmitJob
from exo_tasks.store import Store, UnreadableCommand
from exo_tasks.types import JobRecord, JobRequest, JobStatus

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from exo_tasks.runner.process import Engine

log = logging.getLogger("exo_tasks.runner")
INBOX_POLL_S = 1.0


@dataclass(frozen=True)
class Refused:
    """A job the intake refused: the loop fails it without looking at its prompt."""

    command: SubmitJob
    error: str


Command = RunnerCommand | UnreadableCommand | Refused


@dataclass(frozen=True)
class Screen:
    """What the intake refuses: with the model's tokenizer (None: the loop counts alone), a
    prompt over `cap` tokens for certain."""

    tokenizer: Tokenizer | None
    cap: int

    def __call__(self, command: RunnerCommand | UnreadableCommand) -> Command:
        if not isinstance(command, SubmitJob) or self.tokenizer is None:
            return command
        request = command.job.request
        try:
            prompt_tokens.check(self.tokenizer, request.prompt, request.messages, self.cap)
        except prompt_tokens.PromptTooLong as exc:
            return Refused(command, f"{exc.field}: {exc}")
        except Exception:  # the loop's exact count decides, and names the error
            log.exception("counting a prompt failed", extra={"job_id": command.job.id})
        return command


def prompt_tokens_of(engine: Engine, request: JobRequest, cap: int) -> list[int]:
    """The request's prompt tokens (after the chat template), counted exactly by the loop;
    ValueError, naming the cap, if they are more than `cap`."""
    try:
        tokens = engine.encode(request.prompt, request.messages, request.tools)
    except Exception as exc:  # any tokenizer or template error is the job's
        raise ValueError(f"could not encode the prompt: {exc}") from exc
    if len(tokens) > cap:
        raise ValueError(
            f"the prompt is {len(tokens)} tokens after the chat template; "
            f"at most {cap} (EXO_MAX_PROMPT_TOKENS)"
        )
    return tokens


def refusal(job: JobRecord, error: str, *, its_input: bool) -> JobRecord:
    """How a job handed over ends when it cannot join the batch; `its_input`: for what the
    job asked (the client's error, answered as a 4xx), not for what the runner met."""
    return job.ended(
        JobStatus.FAILED,
        text="",
        finish_reason=None,
        completion_tokens=0,
        error=error,
        refused=its_input,
    )


def read_inbox(
    store: Store, runner_id: str, commands: queue.Queue[Command], screen: Screen
) -> None:
    """Move the runner's Redis inbox into `commands`, each command screened, from a thread of
    its own."""

    def read() -> None:
        while True:
            try:
                command = store.runners.next_command(runner_id, INBOX_POLL_S)
            except Exception:
                log.exception("reading the inbox failed; retrying")
                time.sleep(INBOX_POLL_S)
                continue
            if command is not None:
                commands.put(screen(command))

    threading.Thread(target=read, name="inbox", daemon=True).start()
