"""The `exo-tasks submit` and `cancel` commands, and the argument checks of every job command.

Defaults and bounds are the API's own, read from the request model (exo_tasks.types), so an
argument the API would refuse is refused here first, naming the values it takes."""

from __future__ import annotations

import argparse
import math
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from annotated_types import Ge, Gt, Le, Lt

from exo_tasks.cli.client import ACTIVE_STATUSES, ApiClient
from exo_tasks.errors import ExoError
from exo_tasks.types import MAX_STOP_STRINGS, JobRequest, Priority

# How long `cancel` waits for the job's final status by default: a running job ends at its
# runner's next step, a queued one at once.
CANCEL_WAIT_S = 10.0
# What a shell reports for a command ended by SIGINT (128 + 2).
INTERRUPTED_EXIT = 130
Bound = Ge | Gt | Le | Lt
_BOUND_WORDS: dict[type, tuple[str, str, Callable[[Any, Any], bool]]] = {
    Ge: ("ge", ">=", lambda v, b: v >= b),
    Gt: ("gt", ">", lambda v, b: v > b),
    Le: ("le", "<=", lambda v, b: v <= b),
    Lt: ("lt", "<", lambda v, b: v < b),
}


def field_bounds(field: str) -> list[Bound]:
    """The bounds the API checks on a job request's field (also inside `X | None`)."""
    info = JobRequest.model_fields[field]
    found = list(info.metadata)
    for arg in typing.get_args(info.annotation):
        for meta in getattr(arg, "__metadata__", ()):
            found.extend(getattr(meta, "metadata", ()))
    return [m for m in found if isinstance(m, Ge | Gt | Le | Lt)]


def default(field: str) -> Any:
    """The API's default for a job request's field."""
    return JobRequest.model_fields[field].default


def bounded(convert: Callable[[str], Any], bounds: Sequence[Bound]) -> Callable[[str], Any]:
    """An argparse type: `convert`, then every bound checked; the error names the range."""

    def describe() -> str:
        parts = []
        for bound in bounds:
            attr, symbol, _ = _BOUND_WORDS[type(bound)]
            parts.append(f"{symbol} {getattr(bound, attr)}")
        return " and ".join(parts)

    def parse(raw: str) -> Any:
        kind = "an integer" if convert is int else "a number"
        try:
            value = convert(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{raw}' is not {kind} {describe()}") from None
        for bound in bounds:
            attr, _, holds = _BOUND_WORDS[type(bound)]
            if not (math.isfinite(value) and holds(value, getattr(bound, attr))):
                raise argparse.ArgumentTypeError(f"{raw} is out of range: must be {describe()}")
        return value

    parse.__name__ = convert.__name__  # argparse names the type in its messages
    return parse


def add_submit_arguments(submit: argparse.ArgumentParser, max_tokens_cap: int) -> None:
    """The submit arguments; --max-tokens up to `max_tokens_cap`, the cap the API enforces
    (EXO_MAX_TOKENS: its 422 beyond it, refused here first)."""
    submit.add_argument("prompt", help="the prompt (the user message, with --system)")
    submit.add_argument(
        "--max-tokens",
        type=bounded(int, [*field_bounds("max_tokens"), Le(max_tokens_cap)]),
        default=default("max_tokens"),
        help=f"tokens to generate, 1 to {max_tokens_cap} (EXO_MAX_TOKENS, the API's cap) "
        "(default: %(default)s)",
    )
    submit.add_argument(
        "--temperature",
        type=bounded(float, field_bounds("temperature")),
        default=default("temperature"),
        help="sampling temperature, 0 to 2; 0 is greedy (default: %(default)s)",
    )
    submit.add_argument(
        "--top-p",
        type=bounded(float, field_bounds("top_p")),
        default=default("top_p"),
        help="nucleus sampling: the smallest set of tokens with this much probability, "
        "0 < p <= 1 (default: %(default)s)",
    )
    submit.add_argument(
        "--seed",
        type=bounded(int, field_bounds("seed")),
        default=default("seed"),
        help="random seed, 0 <= seed < 2^64, for repeatable sampling (default: none)",
    )
    submit.add_argument(
        "--stop",
        action=_AppendStop,
        type=_stop_string,
        default=None,
        metavar="TEXT",
        help=f"end the output before this string; repeat for up to {MAX_STOP_STRINGS}",
    )
    submit.add_argument(
        "--priority",
        choices=typing.get_args(Priority),
        default=default("priority"),
        help="the job's place in its queue (default: %(default)s)",
    )
    submit.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly --max-tokens, past the end-of-sequence token (benchmarks)",
    )
    submit.add_argument("--system", default=None, help="a system message before the prompt")
    submit.add_argument(
        "--timeout",
        type=bounded(float, [Gt(0)]),
        default=default("timeout_s"),
        metavar="SECONDS",
        help="the job's time limit; it then ends timed_out with its text so far "
        "(default: the server's EXO_JOB_SOFT_TIME_LIMIT_S)",
    )
    submit.add_argument("--model", default=None, help="model slug or path (default: the first)")
    submit.add_argument(
        "-q", "--quiet", action="store_true", help="a progress bar on stderr, then the text"
    )


class _AppendStop(argparse.Action):
    """`--stop` repeated, up to the API's number of stop strings."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, value: Any, option: Any = None
    ) -> None:
        stops = [*(getattr(namespace, self.dest) or []), value]
        if len(stops) > MAX_STOP_STRINGS:
            raise argparse.ArgumentError(self, f"at most {MAX_STOP_STRINGS} stop strings")
        setattr(namespace, self.dest, stops)


def _stop_string(raw: str) -> str:
    if not raw:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return raw


def add_cancel_arguments(cancel: argparse.ArgumentParser) -> None:
    cancel.add_argument("job_id")
    cancel.add_argument(
        "--wait",
        type=bounded(float, [Ge(0)]),
        default=CANCEL_WAIT_S,
        metavar="SECONDS",
        help="wait this long at most for the job's final status (default: %(default)s)",
    )


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /v1/jobs body the submit arguments ask for."""
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "priority": args.priority,
        "ignore_eos": args.ignore_eos,
    }
    if args.system is not None:
        body["messages"] = [
            {"role": "system", "content": args.system},
            {"role": "user", "content": args.prompt},
        ]
    else:
        body["prompt"] = args.prompt
    optional = {
        "seed": args.seed,
        "stop": args.stop,
        "timeout_s": args.timeout,
        "model": args.model,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def submit(client: ApiClient, args: argparse.Namespace) -> None:
    """Stream the tokens to stdout; with --quiet, a progress bar on stderr, then the text.
    Ctrl-C cancels the job and exits 130."""
    body = job_body(args)
    job_id: str | None = None
    try:
        job_id = client.call("POST", "/v1/jobs", body)["id"]
        print(f"job {job_id}", file=sys.stderr)
        _stream(client, job_id, args.max_tokens, args.quiet)
    except KeyboardInterrupt:
        _interrupted(client, job_id)


def _stream(client: ApiClient, job_id: str, max_tokens: int, quiet: bool) -> None:
    tokens = 0
    for event, data in client.events(job_id):
        if event == "token":
            tokens = max(data.get("tokens", 0), tokens + 1)  # tokens, not events
            if quiet:
                _progress_bar(tokens, max_tokens)
            else:
                print(data["text"], end="", flush=True)
        elif event == "requeued":
            tokens = 0
        elif event in ("done", "error"):
            if quiet:
                if tokens:
                    # The job's own count: its last tokens may have had no text (a stop string).
                    _progress_bar(data["usage"]["completion_tokens"], max_tokens)
                    print(file=sys.stderr, flush=True)  # end the bar's line before the text
                print(data["output"]["text"], end="", flush=True)
            reason = data["output"]["finish_reason"] or data["error"]
            print(f"\n[{data['status']}: {reason}]", file=sys.stderr)


def _progress_bar(done: int, total: int, width: int = 30) -> None:
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    print(f"\r[{bar}] {done}/{total} tokens", end="", file=sys.stderr, flush=True)


def _interrupted(client: ApiClient, job_id: str | None) -> None:
    """Ctrl-C: cancel the job (when it was created), say so, exit 130. A second Ctrl-C
    while cancelling leaves at once, naming the command that cancels it."""
    print(file=sys.stderr)  # off the line the tokens or the bar were on
    try:
        if job_id is not None:
            client.call("POST", f"/v1/jobs/{job_id}/cancel")
            print(f"cancelled job {job_id}", file=sys.stderr)
    except ExoError as exc:
        print(f"exo-tasks: job {job_id} not cancelled: {exc.message}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"job {job_id} left as it is: `exo-tasks cancel {job_id}`", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)


def cancel(client: ApiClient, args: argparse.Namespace) -> None:
    """Cancel, then wait (at most --wait) for the job's final status and print it."""
    job = client.call("POST", f"/v1/jobs/{args.job_id}/cancel")
    job = client.wait_ended(job, args.wait)
    print(f"job {job['id']}: {job['status']}")
    if job["status"] in ACTIVE_STATUSES:
        print(f"exo-tasks: job not ended after {args.wait:g}s", file=sys.stderr)
        sys.exit(1)
