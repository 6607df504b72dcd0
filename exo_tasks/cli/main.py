"""The `exo-tasks` command: run the stack or one of its processes, make models, and submit and
manage jobs, runners and hosts through the API."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.settings import Settings
from exo_tasks.cli.table import listing, timestamp
from exo_tasks.errors import ExoError
from exo_tasks.logs import configure_logging

if TYPE_CHECKING:
    from exo_tasks.cli.client import ApiClient

# The commands that run the stack or one of its processes. For these the commands against the
# API, whose modules import the job models, are left out of the parser and never imported: the
# launcher and `exo-tasks redis` stay up for as long as the stack (~25 MiB less each).
STACK_COMMANDS = ("up", "down", "redis", "api", "worker", "flower", "model")


def _exec(argv: list[str]) -> None:
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def cmd_up(settings: Settings, args: argparse.Namespace) -> None:
    """The whole stack from the Procfile: redis (unless EXO_REDIS_URL or EXO_REDIS_SENTINELS
    is set), api, worker, flower, stopped in order on Ctrl-C."""
    from exo_tasks import launcher

    if args.ha:  # for every process of the stack, which inherit it
        os.environ["EXO_REDIS_HA"] = "true"
        settings = Settings()
    sys.exit(launcher.up(settings))


def cmd_down(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks import launcher

    sys.exit(launcher.down(settings))


def cmd_redis(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_ha import ha_argvs
    from exo_tasks.redis_server import embedded_argvs, run_embedded

    members = ha_argvs(settings) if settings.redis_ha else embedded_argvs(settings)
    sys.exit(run_embedded(settings, members))


def cmd_api(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    wait_for_redis(settings.effective_redis_url)
    conf = "python:exo_tasks.api.gunicorn_conf"
    _exec([sys.executable, "-m", "gunicorn", "-c", conf, "exo_tasks.api:create_app()"])


def cmd_worker(settings: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    if not settings.models:
        _ensure_default_model(settings.default_model_dir)
    if args.in_stack:
        # Part of a local stack, which stops as one: the drain window must end before Redis
        # stops (and before honcho's SIGKILL).
        settings = settings.model_copy(update={"worker_soft_shutdown_s": settings.stack_drain_s})
    wait_for_redis(settings.effective_redis_url)
    from exo_tasks.worker import app as worker_app

    worker_app.main(settings, args.concurrency)


def _ensure_default_model(directory: Path) -> None:
    """The default model, made by a process of its own if it is not there: numpy and the
    tokenizer's library, which making it imports, would stay in the worker's main process and
    in everything it forks (~10 MiB of a worker host)."""
    import multiprocessing

    from config.settings import DEFAULT_PRESET
    from exo_tasks import modelgen

    if modelgen.is_made(DEFAULT_PRESET, directory):
        return
    maker = multiprocessing.get_context("spawn").Process(
        target=modelgen.create_model, args=(DEFAULT_PRESET, directory), name="model maker"
    )
    maker.start()
    maker.join()
    if maker.exitcode != 0:
        raise ExoError(f"making the default model in {directory} failed")


def cmd_flower(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    wait_for_redis(settings.effective_redis_url)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "exo_tasks.flower_app",
        "flower",
        f"--port={settings.flower_port}",
        "--address=127.0.0.1",
    ]
    if settings.flower_basic_auth is not None:
        # By environment: every local user sees a command line in `ps`.
        os.environ["FLOWER_BASIC_AUTH"] = settings.flower_basic_auth.get_secret_value()
    _exec(argv)


def cmd_model_create(_: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.modelgen import create_model

    path = create_model(args.preset, Path(args.dir))
    print(f"wrote the {args.preset} model to {path}")


# --- commands against the API (EXO_API_URL, with EXO_API_TOKEN) ---


def _client(settings: Settings) -> ApiClient:
    from exo_tasks.cli.client import ApiClient

    token = settings.api_token.get_secret_value() if settings.api_token else None
    return ApiClient(settings.effective_api_url, token)


def cmd_submit(settings: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.cli import jobs as cli_jobs

    cli_jobs.submit(_client(settings), args)


# What each listing shows: its route, its columns, and one row per item.
LISTINGS: dict[str, tuple[str, list[str], Callable[[dict[str, Any]], list[Any]]]] = {
    "jobs": (
        "/v1/jobs",
        ["ID", "STATUS", "MODEL", "HOST", "TOKENS", "FINISH", "CREATED", "ERROR"],
        lambda j: [
            j["id"],
            j["status"],
            j["model"],
            j["host"],
            f"{j['usage']['completion_tokens']}/{j['request']['max_tokens']}",
            j["output"]["finish_reason"],
            timestamp(j["created_at"]),
            _one_line(j["error"]),
        ],
    ),
    "runners": (
        "/v1/runners",
        ["ID", "STATUS", "PID", "ACTIVE", "RESTARTS", "ERROR"],
        lambda r: [r["id"], r["status"], r["pid"], r["active_jobs"], r["restarts"], r["error"]],
    ),
    "hosts": (
        "/v1/hosts",
        ["HOST", "PID", "CONCURRENCY", "RUNNERS", "QUEUED"],
        lambda h: [
            h["name"],
            h["pid"],
            h["concurrency"],
            ", ".join(f"{r['model']}:{r['status']}" for r in h["runners"]),
            sum(h["queues"].values()),
        ],
    ),
}
# A job's error in the last column, cut to this: `GET /v1/jobs/<id>` has it whole.
ERROR_CHARS = 60


def _one_line(text: str | None) -> str | None:
    if text is None:
        return None
    line = " ".join(text.split())
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 1] + "…"


def cmd_list(settings: Settings, args: argparse.Namespace) -> None:
    path, headers, row = LISTINGS[args.command]
    params = {"status": args.status, "limit": args.limit} if args.command == "jobs" else {}
    items = _client(settings).call("GET", path, **{k: v for k, v in params.items() if v})
    nothing = f"no {args.command}"
    if params.get("status"):
        nothing += f" with status {args.status}"
    print(listing(headers, [row(item) for item in items], nothing))


def cmd_cancel(settings: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.cli import jobs as cli_jobs

    cli_jobs.cancel(_client(settings), args)


def cmd_shutdown(settings: Settings, args: argparse.Namespace) -> None:
    body: dict[str, Any] = {"mode": args.mode}
    if args.what == "runner":
        if args.timeout is not None:
            body["timeout_s"] = args.timeout
        reply = _client(settings).call("POST", f"/v1/runners/{args.id}/shutdown", body)
    else:
        reply = _client(settings).call("POST", f"/v1/hosts/{args.id}/shutdown", body)
    print(json.dumps(reply))


def build_parser(settings: Settings, api_commands: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exo-tasks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run the whole stack (redis, api, worker, flower)")
    up.add_argument(
        "--ha",
        action="store_true",
        help="Redis as a master, a replica and three Sentinels that fail over (EXO_REDIS_HA)",
    )
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop the stack `up` started from this data dir").set_defaults(
        func=cmd_down
    )
    sub.add_parser("redis", help="run the embedded redis-server").set_defaults(func=cmd_redis)
    sub.add_parser("api", help="run the HTTP API (gunicorn)").set_defaults(func=cmd_api)
    worker = sub.add_parser("worker", help="run this host's worker and its runners")
    worker.add_argument("-c", "--concurrency", type=int, default=None)
    worker.add_argument(
        "--in-stack",
        action="store_true",
        help="part of a local stack (the Procfile): drain for EXO_STACK_DRAIN_S, not "
        "EXO_WORKER_SOFT_SHUTDOWN_S",
    )
    worker.set_defaults(func=cmd_worker)
    sub.add_parser("flower", help="run the Flower monitoring UI").set_defaults(func=cmd_flower)
    model = sub.add_parser("model", help="make models").add_subparsers(dest="action", required=True)
    create = model.add_parser("create", help="write a random-weight model from a preset")
    create.add_argument("preset", choices=["tiny", "chat", "bench"])
    create.add_argument("dir")
    create.set_defaults(func=cmd_model_create)
    if api_commands:
        _add_api_commands(sub, settings)
    return parser


def _add_api_commands(sub: Any, settings: Settings) -> None:
    from annotated_types import Ge, Le

    from exo_tasks.cli import batch as cli_batch
    from exo_tasks.cli import instances as cli_instances
    from exo_tasks.cli import jobs as cli_jobs
    from exo_tasks.types import MAX_LIST_LIMIT, JobStatus

    submit = sub.add_parser("submit", help="submit a job and stream its tokens (Ctrl-C cancels it)")
    cli_jobs.add_submit_arguments(submit, settings.max_tokens)
    submit.set_defaults(func=cmd_submit)
    jobs = sub.add_parser("jobs", help="recent jobs, as a table")
    jobs.add_argument(
        "--status",
        default=None,
        choices=[s.value for s in JobStatus],
        help="only jobs in this status",
    )
    jobs.add_argument(
        "--limit",
        type=cli_jobs.bounded(int, [Ge(1), Le(MAX_LIST_LIMIT)]),
        default=20,
        help=f"how many, 1 to {MAX_LIST_LIMIT} (default: %(default)s)",
    )
    jobs.set_defaults(func=cmd_list)
    for name in ("runners", "hosts"):
        sub.add_parser(name, help=f"the {name}, as a table").set_defaults(func=cmd_list)
    cancel = sub.add_parser("cancel", help="cancel a job and print how it ended")
    cli_jobs.add_cancel_arguments(cancel)
    cancel.set_defaults(func=cmd_cancel)
    shutdown = sub.add_parser("shutdown", help="stop a runner or a whole host")
    what = shutdown.add_subparsers(dest="what", required=True)
    runner = what.add_parser("runner", help="stop one runner (warm: finish jobs; hard: now)")
    runner.add_argument("id")
    runner.add_argument("--mode", choices=["warm", "hard"], default="warm")
    runner.add_argument("--timeout", type=float, default=None, help="seconds, for warm")
    host = what.add_parser("host", help="stop a host's worker (warm or cold)")
    host.add_argument("id")
    host.add_argument("--mode", choices=["warm", "cold"], default="warm")
    shutdown.set_defaults(func=cmd_shutdown)
    cli_batch.register(sub, _client)
    cli_instances.register(sub, _client)


def main(argv: list[str] | None = None) -> None:
    settings = Settings()
    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    api_commands = not words or words[0] not in STACK_COMMANDS
    args = build_parser(settings, api_commands).parse_args(argv)
    configure_logging(settings.log_level, host=settings.hostname, process=args.command)
    try:
        args.func(settings, args)
    except ExoError as exc:
        print(f"exo-tasks: {exc.message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # a command with nothing to undo: no traceback
        from exo_tasks.cli.jobs import INTERRUPTED_EXIT

        print(file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)


if __name__ == "__main__":
    main()
