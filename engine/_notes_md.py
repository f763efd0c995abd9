"""Notes mirrored as Markdown files (seed 000): ``Config(notes_markdown_dir=...)``.

One file per note, ``DIR/<user>/<note>.md``, with YAML front matter (id, user, tags, times)
and the note's text as the body: written when a note is stored, rewritten when it is updated,
removed when it is deleted or its user forgotten. The store stays the source of truth: the
files are a view for people and tools that read Markdown (an editor, a static site, grep).

Every write goes to a temporary file in the same directory, is fsynced and renamed over the
note's file, so a reader never sees half a note. Ids become file names by percent-encoding
every byte that is not an ASCII letter, digit, ``-`` or ``_`` (so ``.``, ``/`` and ``..`` can
never leave the directory or hide a file), cut to a length every filesystem takes, with a hash
of the whole id when cut. A crash between the store's commit and the file's rename leaves a
stale or missing file: ``sync``, run when the engine opens, makes the directory match the store.
It removes only files this store's mirror wrote (they open with its front matter, which ends
with the store's id): Markdown files of anyone else's under the directory, and another store's
sharing it, are left alone. Forgetting a user removes the mirror's
files of the user, and the user's folder once that empties it. A user's folder that is a
symbolic link is never written through nor emptied (a note must not leave the directory),
and the directory must be apart from the store (``_wiring`` refuses one that holds it).

The file operations of concurrent calls run in worker threads and may land in any order, so
each carries the log position of the change it mirrors and they are applied in that order: a
note's write that lands after its user's forget (or its own deletion, or a newer version) is
dropped, where it would have put the forgotten note back until the next open.

A file operation the filesystem refuses (a folder of the note's name, a user's folder
replaced by a file, a full disk) is logged and skipped, never raised: the store committed
the change the caller asked for, and ``sync`` tries again at the next open. A file edited by
hand is rewritten from the store whatever it holds (another encoding too).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors.base.records import Note

from ._files import write_atomically

__all__ = ["NotesMirror", "safe_name"]

log = logging.getLogger("engram.notes")

MAX_NAME = 180  # bytes of a file name before ".md": ext4 and most others allow 255
_SAFE = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_decode_note = msgspec.msgpack.Decoder(Note).decode
_FRONT = b"---\nid: "  # how every file the mirror writes begins (``render``)
_HEAD_BYTES = 64 * 1024  # the front matter is in it: ids and tags are bounded


def safe_name(identifier: str) -> str:
    """A file name for an id: percent-encoded, never ``.``-led, at most ``MAX_NAME`` bytes."""
    name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in identifier.encode())
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(identifier.encode()).hexdigest()[:16]
        name = f"{name[:MAX_NAME - 17]}~{digest}"
    return name


def render(note: Note, store_id: str = "") -> str:
    """The note as Markdown with front matter (JSON strings are valid YAML scalars); its
    last field names the store that wrote it (``store_id``), when there is one."""
    head = [
        "---",
        f"id: {json.dumps(note.note_id, ensure_ascii=False)}",
        f"user: {json.dumps(note.user_id, ensure_ascii=False)}",
        f"tags: {json.dumps(list(note.tags), ensure_ascii=False)}",
        f"category: {json.dumps(note.category, ensure_ascii=False)}",
        f"importance: {note.importance!r}",
        f"emotion: {json.dumps(note.emotion, ensure_ascii=False)}",
        f"created_at: {note.created_at.isoformat()}",
        f"updated_at: {note.updated_at.isoformat()}",
        *([f"store: {json.dumps(store_id)}"] if store_id else []),
        "---",
        "",
    ]
    return "\n".join(head) + "\n" + note.text.rstrip("\n") + "\n"


class NotesMirror:
    """Writes and removes the Markdown files; every file operation runs in a worker thread."""

    def __init__(self, root: Path, store_id: str = "") -> None:
        self.root = root
        # The store's id, in every file it writes: a file of another store's sharing the
        # folder is never removed (nor one of a user this store never had).
        self.store_id = store_id
        self._lock = threading.Lock()  # one file operation at a time, each checked under it
        self._newest: dict[Path, int] = {}  # the log position each file last mirrored
        self._gone: dict[str, int] = {}  # user directory -> the lsn of the user's forget

    def _ours(self, path: Path) -> bool:
        """Whether a file is one this store's mirror wrote (or one of no store, written
        before files named theirs)."""
        return _store_of(path) in ("", self.store_id)

    def path(self, user_id: str, note_id: str) -> Path:
        return self.root / safe_name(user_id) / f"{safe_name(note_id)}.md"

    async def write(self, note: Note) -> None:
        await trio.to_thread.run_sync(self._mirror, note.user_id, note.note_id, note.lsn, note)

    async def remove(self, user_id: str, note_id: str, lsn: int) -> None:
        """Remove the note's file, for its deletion at ``lsn``."""
        await trio.to_thread.run_sync(self._mirror, user_id, note_id, lsn, None)

    async def remove_user(self, user_id: str, lsn: int) -> None:
        """Remove the user's directory, for the user's forget at ``lsn``."""
        await trio.to_thread.run_sync(self._remove_user, user_id, lsn)

    def _mirror(self, user_id: str, note_id: str, lsn: int, note: Note | None) -> None:
        path = self.path(user_id, note_id)
        with self._lock:
            if lsn <= max(self._newest.get(path, 0), self._gone.get(path.parent.name, 0)):
                return  # a later change of this file (or of its user) is mirrored already
            self._newest[path] = lsn
            try:
                if note is None:
                    path.unlink(missing_ok=True)
                else:
                    self._write(note)
            except OSError as exc:
                _skipped(path, exc)

    def _remove_user(self, user_id: str, lsn: int) -> None:
        """The mirror's files of the user go, and the user's folder if that empties it:
        anything else in it (a file of the operator's) stays, and a folder that is a link
        is not followed (the mirror never wrote through one)."""
        directory = self.root / safe_name(user_id)
        with self._lock:
            self._gone[directory.name] = max(lsn, self._gone.get(directory.name, 0))
            for path in [p for p in self._newest if p.parent == directory]:
                del self._newest[path]
            if directory.is_symlink() or not directory.is_dir():
                return
            try:
                for path in directory.iterdir():
                    if path.suffix == ".md" and self._ours(path):
                        path.unlink(missing_ok=True)
                directory.rmdir()
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    _skipped(directory, exc)

    async def sync(self, store: Any) -> int:
        """Make the directory match the store's notes; returns the files written or removed."""
        notes = await store.read(_read_all_notes)
        return await trio.to_thread.run_sync(self._sync, notes)

    def _write(self, note: Note) -> None:
        path = self.path(note.user_id, note.note_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent.is_symlink():
            # A link put there by someone else: a note written through it would leave the
            # notes folder, and its user's forget could not take it back.
            raise OSError(errno.ELOOP, "the user's folder is a symbolic link, not followed")
        write_atomically(path, render(note, self.store_id).encode("utf-8"))

    def _sync(self, notes: Iterable[Note]) -> int:
        changed = 0
        wanted: set[Path] = set()
        for note in notes:
            path = self.path(note.user_id, note.note_id)
            wanted.add(path)
            try:
                current = path.read_bytes()
            except OSError:  # none, or a folder of its name (rewriting it says which)
                current = None
            if current != render(note, self.store_id).encode("utf-8"):
                try:
                    self._write(note)
                except OSError as exc:
                    _skipped(path, exc)
                    continue
                changed += 1
        if self.root.is_dir():
            # Each user's own folder, never one a link points to elsewhere.
            found = [path for folder in self.root.iterdir()
                     if folder.is_dir() and not folder.is_symlink()
                     for path in folder.glob("*.md")]
            for path in found:
                if path not in wanted and self._ours(path):
                    try:
                        path.unlink(missing_ok=True)
                    except OSError as exc:
                        _skipped(path, exc)
                        continue
                    changed += 1
        return changed


def _store_of(path: Path) -> str | None:
    """The store a mirror file names (``""``: a file written before files named theirs), or
    None for a file the mirror did not write."""
    try:
        with open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError:  # a folder of that name, or unreadable: not one to remove
        return None
    if not head.startswith(_FRONT):
        return None
    end = head.find(b"\n---\n", len(_FRONT))
    for line in head[: end if end >= 0 else len(head)].split(b"\n"):
        if line.startswith(b"store: "):
            try:
                found = json.loads(line[len(b"store: "):])
            except ValueError:
                return None
            return found if isinstance(found, str) else None
    return ""


def _skipped(path: Path, exc: OSError) -> None:
    log.warning("notes mirror: %s left as it is (%s); the store keeps the note, and the next "
                "open writes the file again", path, exc.strerror or exc)


def _read_all_notes(txn: Any, dbs: dict[bytes, Any]) -> list[Note]:
    return [_decode_note(value) for _, value in txn.cursor(dbs[b"notes"])]
