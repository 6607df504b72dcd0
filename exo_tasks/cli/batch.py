"""`exo-tasks batch ...`: submit a JSONL file as an OpenAI batch and follow it, list batches,
show or cancel one, and download its results, through the API (EXO_API_URL, EXO_API_TOKEN)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.settings import Settings
from exo_tasks.batch_types import BATCH_ENDED
from exo_tasks.cli.client import ApiClient
from exo_tasks.cli.table import listing, timestamp
from exo_tasks.errors import ExoError

POLL_S = 1.0
DEFAULT_ENDPOINT = "/v1/chat/completions"
ClientFactory = Callable[[Settings], ApiClient]


class BatchClient:
    """The Files and Batch routes, over the CLI's API client (multipart up, bytes down)."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api

    def upload(self, path: Path) -> str:
        with path.open("rb") as file:
            response = self.api.request(
                "POST", "/v1/files", files={"file": (path.name, file)}, data={"purpose": "batch"}
            )
        file_id: str = response.json()["id"]
        return file_id

    def content(self, file_id: str) -> bytes:
        return self.api.request("GET", f"/v1/files/{file_id}/content").content

    def batch(self, batch_id: str) -> dict[str, Any]:
        batch: dict[str, Any] = self.api.call("GET", f"/v1/batches/{batch_id}")
        return batch


def _endpoint_of(path: Path) -> str:
    """The endpoint the file's first request names (every line must name the same one)."""
    with path.open("rb") as file:
        for raw in file:
            if raw.strip():
                try:
                    url = json.loads(raw).get("url")
                except (ValueError, AttributeError):
                    return DEFAULT_ENDPOINT  # the batch fails validation, naming the line
                return str(url) if isinstance(url, str) else DEFAULT_ENDPOINT
    return DEFAULT_ENDPOINT


def cmd_submit(client: BatchClient, args: argparse.Namespace) -> None:
    path = Path(args.file)
    if not path.is_file():
        raise ExoError(f"no file '{path}'")
    body = {
        "input_file_id": client.upload(path),
        "endpoint": args.endpoint or _endpoint_of(path),
        "completion_window": args.window,
    }
    batch = client.api.call("POST", "/v1/batches", body)
    print(f"batch {batch['id']}", file=sys.stderr)
    if not args.wait:
        print(batch["id"])
        return
    batch = _follow(client, batch["id"])
    output = Path(args.output or path.with_suffix(".output.jsonl"))
    _save(client, batch, output)


def _follow(client: BatchClient, batch_id: str) -> dict[str, Any]:
    """Poll the batch until it ends, with a progress bar on stderr."""
    while True:
        batch = client.batch(batch_id)
        _progress(batch)
        if batch["status"] in BATCH_ENDED:
            print(file=sys.stderr)
            return batch
        time.sleep(POLL_S)


def _progress(batch: dict[str, Any], width: int = 30) -> None:
    counts = batch["request_counts"]
    done, total = counts["completed"] + counts["failed"], counts["total"]
    filled = width * done // max(total, 1)
    bar = "#" * filled + "-" * (width - filled)
    line = f"\r[{bar}] {done}/{total} requests, {counts['failed']} failed, {batch['status']}"
    print(line, end="", file=sys.stderr, flush=True)


def _save(client: BatchClient, batch: dict[str, Any], output: Path) -> None:
    """Write the output file (and the error file beside it); the output's path on stdout."""
    if batch["status"] == "failed":
        for error in (batch.get("errors") or {}).get("data") or []:
            print(f"line {error['line']}: {error['code']}: {error['message']}", file=sys.stderr)
        raise ExoError(f"batch {batch['id']} failed validation")
    output.write_bytes(client.content(batch["output_file_id"]) if batch["output_file_id"] else b"")
    if batch["error_file_id"]:
        errors = output.with_suffix(".errors.jsonl")
        errors.write_bytes(client.content(batch["error_file_id"]))
        print(f"{batch['request_counts']['failed']} failed requests: {errors}", file=sys.stderr)
    print(f"batch {batch['id']}: {batch['status']}", file=sys.stderr)
    print(output)


def cmd_list(client: BatchClient, args: argparse.Namespace) -> None:
    listed = client.api.call("GET", "/v1/batches", limit=args.limit)["data"]
    rows = [
        [
            b["id"],
            b["status"],
            b["endpoint"],
            f"{b['request_counts']['completed']}/{b['request_counts']['total']}",
            b["request_counts"]["failed"],
            timestamp(b["created_at"]),
        ]
        for b in listed
    ]
    print(listing(["ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"], rows, "no batches"))


def cmd_status(client: BatchClient, args: argparse.Namespace) -> None:
    print(json.dumps(client.batch(args.batch_id), indent=2))


def cmd_cancel(client: BatchClient, args: argparse.Namespace) -> None:
    batch = client.api.call("POST", f"/v1/batches/{args.batch_id}/cancel")
    print(f"batch {batch['id']}: {batch['status']}")


def cmd_results(client: BatchClient, args: argparse.Namespace) -> None:
    """The output file (or, with --errors, the error file) to -o FILE or stdout."""
    batch = client.batch(args.batch_id)
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if batch["status"] not in BATCH_ENDED:
        raise ExoError(f"batch {batch['id']} is {batch['status']}: no results yet")
    content = client.content(file_id) if file_id else b""
    if args.output:
        Path(args.output).write_bytes(content)
        print(args.output)
    else:
        sys.stdout.buffer.write(content)


def register(sub: Any, client_for: ClientFactory) -> None:
    """Add `batch` and its subcommands to the `exo-tasks` parser."""
    batch = sub.add_parser("batch", help="OpenAI batches: submit a JSONL file, follow, cancel")
    actions = batch.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="upload FILE.jsonl and start it as a batch")
    submit.add_argument("file")
    submit.add_argument("--endpoint", default=None, help="default: the first line's url")
    submit.add_argument("--window", default="24h", help="completion window (24h, 90m, ...)")
    submit.add_argument("--wait", action="store_true", help="follow it, then save the output")
    submit.add_argument("-o", "--output", default=None, help="with --wait: the output's path")
    submit.set_defaults(batch_func=cmd_submit)
    listing = actions.add_parser("list", help="recent batches, as a table")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(batch_func=cmd_list)
    for name, func, what in (
        ("status", cmd_status, "a batch, as JSON"),
        ("cancel", cmd_cancel, "cancel a batch"),
        ("results", cmd_results, "a batch's output file"),
    ):
        action = actions.add_parser(name, help=what)
        action.add_argument("batch_id")
        action.set_defaults(batch_func=func)
        if name == "results":
            action.add_argument("-o", "--output", default=None)
            action.add_argument("--errors", action="store_true", help="the error file instead")

    def run(settings: Settings, args: argparse.Namespace) -> None:
        args.batch_func(BatchClient(client_for(settings)), args)

    batch.set_defaults(func=run)
