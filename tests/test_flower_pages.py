"""Flower's own pages as an operator meets them (exo_tasks.flower_pages), with basic auth on:
in a real browser (headless Chromium, driven by Playwright), a fresh session that opens a task's
page first and clicks Terminate, or Revoke on a task still `PENDING`, cancels its job; through
their HTTP, a worker's page shows its tasks as they are now, and a worker gone offline counts
no active tasks on the dashboard."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.flower import AUTH, Flower
from tests.support.processes import Processes, wait_until
from tests.support.stack import LONG, Stack, TwoHosts, new_worker, wait_tokens

BETA = {"model": "beta"}  # served by fleet-y only
# A job pinned to fleet-x waits in its queue while fleet-x's one pool child is busy.
ON_X = {"host": "fleet-x", "model": "alpha"}
# As the machine's own probe starts it: root needs --no-sandbox; with background networking on,
# Chromium's connections are refused by a closed network, many at a time.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium where it is installed (`make browser`, as CI has it), else Playwright's
    own build (`playwright install chromium`, which `make browser` runs elsewhere)."""
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS
        )
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser session: it answers Flower's basic-auth prompts with the credentials,
    as an operator would, and holds nothing from an earlier page."""
    username, password = AUTH
    context = browser.new_context(http_credentials={"username": username, "password": password})
    try:
        yield context.new_page()
    finally:
        context.close()


def click_on_task_page(page: Page, flower: Flower, task_id: str, button: str) -> None:
    """Open the task's page first (a deep link) and click `button`: Flower's notice says
    the task was revoked, as its API answered the button's POST."""
    page.goto(f"{flower.url}/task/{task_id}")
    with page.expect_response(lambda r: "/api/task/revoke/" in r.url) as answer:
        page.click(button)
    assert answer.value.status == 200, answer.value.text()
    page.get_by_role("status").filter(has_text=task_id).wait_for(timeout=5000)


def test_terminate_on_a_task_page_opened_first_cancels_its_job(
    stack: Stack, flower: Flower, page: Page
) -> None:
    job_id = stack.api.submit(**LONG, **BETA)
    wait_tokens(stack, job_id)
    flower.wait_state(job_id, "STARTED")
    click_on_task_page(page, flower, job_id, "#task-terminate")
    job = stack.api.wait_job(job_id, timeout_s=3)
    assert job["status"] == "cancelled" and job["output"]["text"]
    flower.wait_state(job_id, "REVOKED")


def test_a_pending_task_has_a_revoke_button_that_cancels_its_job(
    stack: Stack, fleet: TwoHosts, flower: Flower, page: Page
) -> None:
    busy = stack.api.submit(**LONG, **ON_X)
    try:
        wait_tokens(stack, busy)
        queued = stack.api.submit(prompt="never", max_tokens=8, **ON_X)
        flower.wait_state(queued, "PENDING")
        click_on_task_page(page, flower, queued, "#task-revoke")
        job = stack.api.wait_job(queued, timeout_s=3)
        assert job["status"] == "cancelled" and job["started_at"] is None
        flower.wait_state(queued, "REVOKED", timeout_s=3)
    finally:
        assert stack.api.post(f"/v1/jobs/{busy}/cancel").status_code == 202
    stack.api.wait_job(busy, timeout_s=3)


def celery_of(stack: Stack) -> Celery:
    celery: Celery = stack.api.app.extensions["exo"].celery
    return celery


def tasks_tab(flower: Flower, worker: str) -> dict[str, str]:
    """The worker page's Tasks tab, its tables by caption (HTML)."""
    page = flower.get(f"/worker/{worker}", auth=AUTH).text
    tab = page.split('id="tab-tasks"')[1].split("<!-- end tasks tab -->")[0]
    tables = tab.split("<caption>")[1:]
    return {table.split("</caption>")[0]: table for table in tables}


def test_a_workers_page_shows_its_tasks_as_they_are_now(stack: Stack, flower: Flower) -> None:
    job_id = stack.api.submit(**LONG, **BETA)
    wait_tokens(stack, job_id)
    assert job_id in tasks_tab(flower, "exo@fleet-y")["Active tasks"]
    flower.revoke(job_id)  # Celery's revoke: the worker lists the id as revoked
    assert stack.api.wait_job(job_id, timeout_s=3)["status"] == "cancelled"
    inspect = celery_of(stack).control.inspect(destination=["exo@fleet-y"], timeout=5)
    wait_until(lambda: job_id not in str(inspect.active()), 10, "the worker to end the job's task")
    # Loaded again: not the inspection made for the first load (Flower's cache) but a new one.
    tab = tasks_tab(flower, "exo@fleet-y")
    assert job_id not in tab["Active tasks"] and job_id in tab["Revoked tasks"]


def dashboard_row(flower: Flower, worker: str) -> dict[str, Any]:
    """The worker's row on Flower's dashboard (Workers), as its page polls it."""
    rows = flower.get("/workers", params={"json": "1"}, auth=AUTH).json()["data"]
    row: dict[str, Any] = next(r for r in rows if r["hostname"] == worker)
    return row


def test_a_worker_gone_offline_counts_no_active_tasks(
    stack: Stack, flower: Flower, processes: Processes, tiny_model: Path, tmp_path: Path
) -> None:
    host, node = "fl-gone", "exo@fl-gone"
    worker = new_worker(stack, processes, tiny_model, tmp_path, host)
    job_id = stack.api.submit(**LONG, host=host)
    wait_tokens(stack, job_id)
    # Its heartbeats (every 2 s) count the running task.
    wait_until(lambda: dashboard_row(flower, node).get("active") == 1, 10, "active 1 in Flower")
    worker.process.kill()
    worker.process.wait(timeout=10)
    # Offline once its heartbeats expire (twice their period after the last one).
    row = wait_until(
        lambda: (r := dashboard_row(flower, node))["status"] is False and r, 15, "offline"
    )
    assert not row["active"], row
    assert stack.api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
