"""The chaos suite's report: each case records what it broke and what it observed. The
session writes it to an untracked artefact (REPORT); under pytest-xdist each worker sends its
cases to the controller, which writes them all; `make reliability-report` copies the last
one into docs/reliability.md, so a test run never leaves the clone dirty."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPORT = Path(__file__).resolve().parents[2] / "var" / "reports" / "reliability.md"


@dataclass
class Case:
    name: str
    jobs: int
    faults: str
    lost: int
    bounds: list[str] = field(default_factory=list)


@dataclass
class Report:
    cases: list[Case] = field(default_factory=list)

    def add(self, case: Case) -> None:
        self.cases.append(case)

    def as_data(self) -> list[dict[str, Any]]:
        """The cases as plain data, as a pytest-xdist worker sends them to the controller."""
        return [asdict(c) for c in self.cases]

    def extend(self, data: list[dict[str, Any]]) -> None:
        self.cases.extend(Case(**case) for case in data)

    def write(self) -> None:
        if self.cases:
            REPORT.parent.mkdir(parents=True, exist_ok=True)
            REPORT.write_text(self.markdown())

    def markdown(self) -> str:
        rows = "\n".join(
            f"| {c.name} | {c.jobs} | {c.faults} | {c.lost} | {'; '.join(c.bounds)} |"
            for c in self.cases
        )
        total = sum(c.jobs for c in self.cases)
        lost = sum(c.lost for c in self.cases)
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        return (
            "# Reliability: what the chaos suite broke, and what it observed\n\n"
            "Written by `tests/chaos/` to `var/reports/reliability.md` on every run and copied "
            "here by `make reliability-report` "
            f"(this run {when}, {platform.system()} {platform.machine()}, "
            f"{len(self.cases)} cases). Every case runs real redis-server, worker, runner and "
            "API processes and breaks them with real signals.\n\n"
            f"**Jobs accepted: {total}. Lost: {lost}.**\n\n"
            "| case | jobs | faults injected | lost | bounds observed |\n"
            "| --- | --- | --- | --- | --- |\n"
            f"{rows}\n\n"
            "kombu's Redis transport pops a message (BRPOP) before it records it as "
            "unacknowledged, so a worker SIGKILLed in between loses the message itself; the "
            "recovery loop sends a queued job whose message is nowhere again (see "
            "docs/shutdown.md). The kill -9 case kills while messages are being fetched.\n"
        )
