"""Which reflection notes quote what: shared by the maintenance passes that write them and
the forget that deletes those quoting a forgotten session (seed 004's reflections)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from actors.base.records import Note

__all__ = ["REFLECTION_WINDOW", "SESSION_REFLECTION", "reflections_quoting", "weekly_note_id"]

_WEEKLY = re.compile(r"reflection-\d{4}-W\d{2}")  # weekly_note_id's form
REFLECTION_WINDOW = timedelta(days=7)  # a reflection quotes what was made this long before it
SESSION_REFLECTION = "reflection-latest"  # the note a session switch rewrites, per user


def weekly_note_id(at: datetime) -> str:
    """The id of the weekly reflection a pass at ``at`` writes (one per ISO week)."""
    year, week, _ = at.isocalendar()
    return f"reflection-{year}-W{week:02d}"


def _written_by_a_pass(note: Note) -> bool:
    """A reflection the passes write (by its id and tag), not a caller's note that happens to
    be tagged ``reflection``: a forget deletes what the engine wrote, never the caller's."""
    return "reflection" in note.tags and (note.note_id == SESSION_REFLECTION
                                          or _WEEKLY.fullmatch(note.note_id) is not None)


def reflections_quoting(notes: list[Note], made: list[datetime]) -> set[str]:
    """The reflections that may quote (or have drawn topics from) facts and episodes made at
    ``made``, which a forget is about to remove: every reflection the passes wrote whose
    window (the REFLECTION_WINDOW up to when it was written) holds one of those times. The
    forget deletes them in its own transaction; the next switch and the next pass write them
    again from what the user still has."""
    return {n.note_id for n in notes if _written_by_a_pass(n)
            and any(n.updated_at - REFLECTION_WINDOW <= at <= n.updated_at for at in made)}
