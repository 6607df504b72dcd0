"""`exo-tasks instances ...`: list the model instances placed across hosts, show one with its
ranks, place one and stop one, through the API (EXO_API_URL, EXO_API_TOKEN)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Any

from config.settings import Settings
from exo_tasks.cli.client import ApiClient
from exo_tasks.cli.table import table
from exo_tasks.instances import Parallel, ShutdownMode

ClientFactory = Callable[[Settings], ApiClient]


def _summary(instance: dict[str, Any]) -> str:
    mode = f" ({instance['shutdown_mode']})" if instance["shutdown_mode"] else ""
    error = f": {instance['error']}" if instance["error"] else ""
    return f"instance {instance['id']}: {instance['status']}{mode}{error}"


def cmd_list(api: ApiClient, _: argparse.Namespace) -> None:
    rows = [
        [i["id"], i["status"], i["model"], i["parallel"], ",".join(i["hosts"]), i["error"]]
        for i in api.call("GET", "/v1/instances")
    ]
    print(table(["ID", "STATUS", "MODEL", "PARALLEL", "HOSTS", "ERROR"], rows))


def cmd_show(api: ApiClient, args: argparse.Namespace) -> None:
    """The instance, then one row per rank."""
    instance = api.call("GET", f"/v1/instances/{args.instance_id}")
    print(_summary(instance))
    print(f"model {instance['model']} ({instance['model_path']}), {instance['parallel']} parallel")
    rows = [
        [r["rank"], r["host"], r["pid"], r["status"], r["weights_bytes"], r["error"]]
        for r in instance["ranks"]
    ]
    print(table(["RANK", "HOST", "PID", "STATUS", "WEIGHTS_BYTES", "ERROR"], rows))


def cmd_place(api: ApiClient, args: argparse.Namespace) -> None:
    body = {"model": args.model, "hosts": args.hosts, "parallel": args.parallel}
    print(_summary(api.call("POST", "/v1/instances", body)))


def cmd_shutdown(api: ApiClient, args: argparse.Namespace) -> None:
    body = {"mode": args.mode}
    print(_summary(api.call("POST", f"/v1/instances/{args.instance_id}/shutdown", body)))


def register(sub: Any, client_for: ClientFactory) -> None:
    """Add `instances` and its subcommands to the `exo-tasks` parser."""
    instances = sub.add_parser("instances", help="models placed across hosts: list, show, place")
    actions = instances.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every instance, as a table").set_defaults(action_func=cmd_list)
    show = actions.add_parser("show", help="an instance and each of its ranks")
    show.add_argument("instance_id")
    show.set_defaults(action_func=cmd_show)
    place = actions.add_parser("place", help="place a model across hosts (rank 0 first)")
    place.add_argument("model", help="a model path (the same on every host), hub id or slug")
    place.add_argument("hosts", nargs="+", metavar="HOST", help="two or more, in rank order")
    place.add_argument(
        "--parallel",
        choices=typing.get_args(Parallel),
        default="tensor",
        help="how the model is split (default: %(default)s)",
    )
    place.set_defaults(action_func=cmd_place)
    shutdown = actions.add_parser("shutdown", help="stop an instance (warm: drain first)")
    shutdown.add_argument("instance_id")
    shutdown.add_argument("--mode", choices=typing.get_args(ShutdownMode), default="warm")
    shutdown.set_defaults(action_func=cmd_shutdown)

    def run(settings: Settings, args: argparse.Namespace) -> None:
        args.action_func(client_for(settings), args)

    instances.set_defaults(func=run)
