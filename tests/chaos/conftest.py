"""The chaos suite's report fixture: the session writes what its cases recorded to
tests.support.report.REPORT (untracked; `make reliability-report` publishes it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.report import REPORT, Report


@pytest.fixture(scope="session")
def reliability() -> Iterator[Report]:
    report = Report()
    yield report
    if report.cases:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(report.markdown())
