"""The conformance run's counts: requests and statuses per operation, failures per class with the
operations they hit and the shortest reproducer seen, and notes (defects worth reading that do not
fail the run). `markdown()` renders them as the report."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .checks import Failure


@dataclass
class FailureClass:
    """Every failure of one kind: how many, where, and one reproducer (the shortest)."""

    count: int = 0
    operations: Counter = field(default_factory=Counter)
    detail: str = ""
    reproducer: str = ""

    def add(self, operation: str, failure: Failure, reproducer: str) -> None:
        self.count += 1
        self.operations[operation] += 1
        if not self.reproducer or len(reproducer) < len(self.reproducer):
            self.reproducer, self.detail = reproducer, failure.detail


@dataclass
class Tally:
    """Counts of one run, by operation (e.g. "POST /v2/models/sampler/infer [negative]")."""

    requests: Counter = field(default_factory=Counter)
    statuses: dict[str, Counter] = field(default_factory=dict)
    failed_requests: Counter = field(default_factory=Counter)
    failures: dict[str, FailureClass] = field(default_factory=dict)
    notes: dict[str, FailureClass] = field(default_factory=dict)

    def record(
        self,
        operation: str,
        status: int | None,
        failures: list[Failure],
        reproducer: str,
        notes: list[Failure] = (),
    ) -> None:
        """One request of `operation`, its status and its failures (each reproduced by `reproducer`)."""
        self.requests[operation] += 1
        self.statuses.setdefault(operation, Counter())["none" if status is None else str(status)] += 1
        if failures:
            self.failed_requests[operation] += 1
        for failure in failures:
            self.failures.setdefault(failure.kind, FailureClass()).add(operation, failure, reproducer)
        for note in notes:
            self.notes.setdefault(note.kind, FailureClass()).add(operation, note, reproducer)

    @property
    def total(self) -> int:
        """Requests recorded."""
        return sum(self.requests.values())

    def markdown(self, title: str) -> str:
        """The report: failure classes (with a reproducer each), notes, then every operation."""
        lines = [f"### {title}", ""]
        failed = sum(self.failed_requests.values())
        lines.append(
            f"{self.total} requests, {failed} with at least one failure, {len(self.failures)} failure classes."
        )
        lines.append("")
        for heading, classes in (("Failure classes", self.failures), ("Notes (do not fail the run)", self.notes)):
            if not classes:
                continue
            lines += [f"#### {heading}", ""]
            for kind, found in sorted(classes.items(), key=lambda item: -item[1].count):
                where = ", ".join(f"{op} ×{n}" for op, n in found.operations.most_common(4))
                more = len(found.operations) - 4
                lines.append(
                    f"- **{kind}** — {found.count} answers; {where}" + (f" and {more} more" if more > 0 else "")
                )
                if found.detail:
                    lines.append(f"  - seen: `{found.detail}`".replace("\n", " "))
                lines += ["  ```", f"  {found.reproducer}", "  ```"]
            lines.append("")
        lines += ["| operation | requests | statuses | failed |", "|---|---:|---|---:|"]
        for operation in sorted(self.requests):
            statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses[operation].items()))
            lines.append(
                f"| {operation} | {self.requests[operation]} | {statuses} | {self.failed_requests[operation]} |"
            )
        return "\n".join(lines) + "\n"
