"""The `exo-tasks` command: run the stack or one of its processes, make models, submit jobs."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from config.settings import Settings
from exo_tasks.errors import ExoError
from exo_tasks.logs import configure_logging

PROCFILE = Path(__file__).resolve().parent.parent / "Procfile"


def _exec(argv: list[str]) -> None:
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def cmd_up(settings: Settings, _: argparse.Namespace) -> None:
    """The whole stack under honcho: redis (unless EXO_REDIS_URL is set), api, worker, flower."""
    from exo_tasks.modelgen import ensure_model

    if not settings.models:
        ensure_model("tiny", settings.tiny_model_dir)
    processes = (
        ["api", "worker", "flower"] if settings.redis_url else ["redis", "api", "worker", "flower"]
    )
    print(f"exo_tasks API   http://{settings.api_host}:{settings.api_port}  (try /v1/runners)")
    print(f"Flower          http://127.0.0.1:{settings.flower_port}")
    print("Ctrl-C stops everything (an in-flight job gets about 3 s: honcho kills after 5 s).")
    # The Procfile's commands are this same `exo-tasks`: make sure they resolve to this install.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    _exec(
        [
            sys.executable,
            "-m",
            "honcho",
            "-f",
            str(PROCFILE),
            "-d",
            os.getcwd(),
            "start",
            *processes,
        ]
    )


def cmd_redis(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_server import redis_server_argv

    _exec(redis_server_argv(settings.redis_port, settings.data_dir / "redis"))


def cmd_api(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    wait_for_redis(settings.effective_redis_url)
    _exec(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"{settings.api_host}:{settings.api_port}",
            "--workers",
            str(settings.api_workers),
            "--worker-class",
            "gthread",
            "--threads",
            "32",
            "--graceful-timeout",
            "5",
            "exo_tasks.api:create_app()",
        ]
    )


def cmd_worker(settings: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    wait_for_redis(settings.effective_redis_url)
    from exo_tasks import worker

    worker.main(args.concurrency)


def cmd_flower(settings: Settings, _: argparse.Namespace) -> None:
    from exo_tasks.redis_server import wait_for_redis

    wait_for_redis(settings.effective_redis_url)
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "exo_tasks.worker",
        "flower",
        f"--port={settings.flower_port}",
        "--address=127.0.0.1",
    ]
    if settings.flower_basic_auth is not None:
        argv.append(f"--basic_auth={settings.flower_basic_auth.get_secret_value()}")
    _exec(argv)


def cmd_model_create(_: Settings, args: argparse.Namespace) -> None:
    from exo_tasks.modelgen import create_model

    path = create_model(args.preset, Path(args.dir))
    print(f"wrote the {args.preset} model to {path}")


def cmd_submit(settings: Settings, args: argparse.Namespace) -> None:
    import requests

    base = os.environ.get("EXO_API_URL", f"http://{settings.api_host}:{settings.api_port}")
    body: dict[str, object] = {"prompt": args.prompt, "max_tokens": args.max_tokens}
    if args.model:
        body["model"] = args.model
    created = requests.post(f"{base}/v1/jobs", json=body, timeout=10)
    if created.status_code != 202:
        raise ExoError(f"{created.status_code}: {created.text}")
    job_id = created.json()["id"]
    print(f"job {job_id}", file=sys.stderr)
    with requests.get(f"{base}/v1/jobs/{job_id}/stream", stream=True, timeout=None) as stream:
        event = ""
        for line in stream.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event == "token":
                print(json.loads(line.removeprefix("data: "))["text"], end="", flush=True)
            elif line.startswith("data: "):
                job = json.loads(line.removeprefix("data: "))
                print(
                    f"\n[{job['status']}: {job['output']['finish_reason'] or job['error']}]",
                    file=sys.stderr,
                )
                return


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exo-tasks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run the whole stack (redis, api, worker, flower)").set_defaults(
        func=cmd_up
    )
    sub.add_parser("redis", help="run the embedded redis-server").set_defaults(func=cmd_redis)
    sub.add_parser("api", help="run the HTTP API (gunicorn)").set_defaults(func=cmd_api)
    worker = sub.add_parser("worker", help="run this host's worker and its runners")
    worker.add_argument("-c", "--concurrency", type=int, default=None)
    worker.set_defaults(func=cmd_worker)
    sub.add_parser("flower", help="run the Flower monitoring UI").set_defaults(func=cmd_flower)
    model = sub.add_parser("model", help="make models").add_subparsers(dest="action", required=True)
    create = model.add_parser("create", help="write a random-weight model from a preset")
    create.add_argument("preset", choices=["tiny", "bench"])
    create.add_argument("dir")
    create.set_defaults(func=cmd_model_create)
    submit = sub.add_parser("submit", help="submit a job and stream its tokens")
    submit.add_argument("prompt")
    submit.add_argument("--max-tokens", type=int, default=64)
    submit.add_argument("--model", default=None)
    submit.set_defaults(func=cmd_submit)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_level, host=settings.hostname, process=args.command)
    try:
        args.func(settings, args)
    except ExoError as exc:
        print(f"exo-tasks: {exc.message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
