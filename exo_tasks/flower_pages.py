"""Flower's own pages, made to show what is current (Flower 2.2.0, as `exo-tasks flower` runs it).

- A task still `PENDING` (its job queued: no worker has its message) gets the Revoke button
  Flower draws only for `RECEIVED` and `RETRY` tasks; its revoke cancels the job
  (exo_tasks.worker.revocation). The one condition is changed as Flower's `task.html` is
  loaded; a Flower whose template no longer has it fails at start, not silently.
- A worker's page is rendered from an inspection made for it. Flower renders a worker it has
  inspected before from that inspection and refreshes in the background: its Tasks tab
  showed tasks long ended until a reload.
- A worker Flower sees offline has no "Active" count: the last heartbeat's stayed on the
  dashboard (and in its "Active tasks" total) after the worker had exited.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tornado.template
import tornado.web
from flower import urls
from flower.inspector import Inspector
from flower.views.workers import WorkersView, WorkerView

# (template, what Flower 2.2.0 has, what it becomes)
EDITS = (
    (
        "task.html",
        '{% elif task.state == "RECEIVED" or task.state == "RETRY" %}',
        '{% elif task.state in ("PENDING", "RECEIVED", "RETRY") %}',
    ),
)


class Templates(tornado.template.Loader):
    """Flower's templates, with EDITS made as each is loaded."""

    def _create_template(self, name: str) -> tornado.template.Template:
        source = Path(self.root, name).read_text(encoding="utf-8")
        for template, old, new in EDITS:
            if template == name:
                source = source.replace(old, new)
        return tornado.template.Template(source, name=name, loader=self)


def _check_edits(root: str) -> None:
    for template, old, _ in EDITS:
        if Path(root, template).read_text(encoding="utf-8").count(old) != 1:
            raise RuntimeError(f"Flower's {template} no longer has {old!r}: see {__name__}")


_worker_page = WorkerView.get


@tornado.web.authenticated  # before the cache is touched
async def _worker_page_inspected_now(handler: WorkerView, name: str) -> None:
    # Without its task lists cached, Flower's view awaits a new inspection of every tab.
    cached = handler.application.workers.get(name, {})
    for method in Inspector.task_inspect_methods:
        cached.pop(method, None)
    await _worker_page(handler, name)


_worker_fields = WorkersView._as_dict


def _without_offline_active(worker: Any) -> dict[str, Any]:
    fields: dict[str, Any] = _worker_fields(worker)
    if not worker.alive:
        fields["active"] = None
    return fields


def install() -> None:
    """Flower reads its settings (urls.settings) and calls its views after the Celery app's
    module has been imported: called from there (exo_tasks.flower_app)."""
    _check_edits(urls.settings["template_path"])
    urls.settings["template_loader"] = Templates(urls.settings["template_path"])
    WorkerView.get = _worker_page_inspected_now
    WorkersView._as_dict = staticmethod(_without_offline_active)
