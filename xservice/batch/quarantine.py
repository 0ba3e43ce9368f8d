"""Which batch lines start now, and which are poison: the runner's line policy (pure).

A line's ``attempts`` counts the runs that ended with no result because the service or its engine
died while it ran (a native crash, an OOM kill, a hang the supervisor killed). A line with such a
run behind it is a *suspect*: it runs alone, nothing in flight beside it, so if it kills the service
again only its count grows and innocent lines that happened to run with it are cleared by running
alone once. A line whose count reached ``max_attempts`` is quarantined: it fails with
``line_quarantined`` and is never sent again, after a restart neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from xservice.batch.lines import error_record
from xservice.batch.store import PendingLine

QUARANTINE_CODE = "line_quarantined"


@dataclass
class LinePick:
    """``start`` now; ``quarantine``; ``wait`` (back to the queue, in order)."""

    start: list[PendingLine] = field(default_factory=list)
    quarantine: list[PendingLine] = field(default_factory=list)
    wait: list[PendingLine] = field(default_factory=list)


def pick_lines(
    queue: Sequence[PendingLine], running: Sequence[PendingLine], room: int, max_attempts: int
) -> LinePick:
    """Split ``queue`` (oldest first) given the lines ``running`` and at most ``room`` in flight.

    Order is kept: once a line has to wait, every later one waits too, so a suspect waiting for
    the lines in flight to drain is not overtaken.
    """
    pick = LinePick()
    busy = list(running)
    for line in queue:
        if line.attempts >= max_attempts:
            pick.quarantine.append(line)
        elif pick.wait or not _may_start(line, busy, room):
            pick.wait.append(line)
        else:
            pick.start.append(line)
            busy.append(line)
    return pick


def _may_start(line: PendingLine, busy: list[PendingLine], room: int) -> bool:
    if len(busy) >= room or any(b.attempts > 0 for b in busy):
        return False  # full, or a suspect runs alone
    return line.attempts == 0 or not busy


def quarantine_record(line: PendingLine, max_attempts: int) -> dict:
    """The error-file record of a quarantined line (OpenAI's batch error shape)."""
    message = (
        f"Not run again: the service or its engine stopped (crashed, was killed or hung) {line.attempts} "
        f"times while this line ran (batch.max_line_attempts = {max_attempts})."
    )
    return error_record(line.custom_id, QUARANTINE_CODE, message)
