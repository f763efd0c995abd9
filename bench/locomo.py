"""LoCoMo conversations for ``bench/recall.py quality``: loading, ingesting, scoring.

The data is not part of the project (CC BY-NC 4.0; measurement only). It is read from a folder
holding ``locomo-dev.json`` in the dataset's own JSON shape: ``--data DIR``, else the
``ENGRAM_QUALITY_DIR`` environment variable, else ``shared/quality`` beside the checkout (or
beside its parent, for a git worktree). The measurement follows that folder's README:

- one store per run, one user per conversation; each LoCoMo session is one session_id, dated by
  its ``session_<n>_date_time``; a turn's text is ``"<speaker>: <text>"``, plus
  ``" [shares <blip_caption>]"`` when an image was shared;
- a hit counts for the turns it stands for (a turn itself, an episode its covered turns, a fact
  its source turns), de-duplicated in rank order; recall@k = |evidence ∩ first k turns| /
  |evidence|, micro-averaged over questions with evidence, category 5 (adversarial) left out;
  recall within 500 / 1,000 whitespace tokens of the returned text;
- two ingest orders: the whole history imported at once (``add_turns``), and turn by turn as a
  live bot sees it (``add_turn``).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from engine import Engine, NewTurn

__all__ = ["Dialogue", "QA", "CATEGORIES", "MODES", "KS", "BUDGETS", "find_data", "load",
           "ingest", "turns_of", "recall_at", "within_tokens", "evaluate", "columns"]

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
TURN_GAP = timedelta(seconds=30)  # turns of a session keep their order under one session date
FILE = "locomo-dev.json"


@dataclass
class QA:
    user_id: str
    text: str
    category: str  # LoCoMo's category by name (multi-hop, temporal...), or convgen's kind
    evidence: list[str]  # dia ids, normalised
    evidence_turn_ids: list[str] = field(default_factory=list)


@dataclass
class Dialogue:
    user_id: str
    roles: dict[str, str]  # speaker name -> engine role
    sessions: list[tuple[str, datetime, list[tuple[str, str, str]]]]  # id, date, (role, text, dia)
    questions: list[QA]


def find_data(explicit: str | None) -> Path | None:
    """The folder holding ``locomo-dev.json``: ``explicit``, ``$ENGRAM_QUALITY_DIR``, or
    ``shared/quality`` beside the checkout (or beside its parent); None when none holds it."""
    if explicit:
        return Path(explicit)
    if os.environ.get("ENGRAM_QUALITY_DIR"):
        return Path(os.environ["ENGRAM_QUALITY_DIR"])
    repo = Path(__file__).resolve().parents[1]
    for base in (repo.parent, repo.parent.parent):
        if (base / "shared" / "quality" / FILE).is_file():
            return base / "shared" / "quality"
    return None


def _date(text: str) -> datetime:
    """'1:56 pm on 8 May, 2023' -> an aware datetime (UTC)."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=timezone.utc)


_DIA = re.compile(r"D:?(\d+):0*(\d+)")


def _evidence(raw: list[str], known: set[str]) -> list[str]:
    """Irregular ids ("D8:6; D9:17", "D:11:26", "D30:05") split and normalised; ids that name
    no turn dropped."""
    found = []
    for item in raw:
        for m in _DIA.finditer(item):
            dia = f"D{int(m.group(1))}:{int(m.group(2))}"
            if dia in known and dia not in found:
                found.append(dia)
    return found


def load(folder: Path) -> list[Dialogue]:
    """The conversations and their questions (category 5 left out)."""
    path = folder / FILE
    if not path.is_file():
        raise SystemExit(f"LoCoMo data: expected {FILE} in {folder}, found no such file; pass "
                         f"--data DIR or set ENGRAM_QUALITY_DIR to a folder holding it")
    dialogues = []
    for item in json.loads(path.read_text()):
        convo = item["conversation"]
        user_id = f"locomo-{item['sample_id']}"
        roles = {convo["speaker_a"]: "user", convo["speaker_b"]: "assistant"}
        sessions, known = [], set()
        numbers = sorted(int(k.split("_")[1]) for k in convo
                         if re.fullmatch(r"session_\d+", k) and convo[k])
        for n in numbers:
            body = []
            for turn in convo[f"session_{n}"]:
                text = f"{turn['speaker']}: {turn['text']}"
                if turn.get("blip_caption"):
                    text += f" [shares {turn['blip_caption']}]"
                m = _DIA.fullmatch(turn["dia_id"].strip())
                dia_id = f"D{int(m[1])}:{int(m[2])}" if m else turn["dia_id"]
                known.add(dia_id)
                body.append((roles[turn["speaker"]], text, dia_id))
            sessions.append((f"session-{n}", _date(convo[f"session_{n}_date_time"]), body))
        questions = []
        for qa in item["qa"]:
            if qa["category"] not in CATEGORIES:
                continue
            evidence = _evidence(qa.get("evidence", []), known)
            if evidence:
                questions.append(QA(user_id, qa["question"], CATEGORIES[qa["category"]],
                                    evidence))
        dialogues.append(Dialogue(user_id, roles, sessions, questions))
    return dialogues


async def ingest(mem: Engine, dialogues: list[Dialogue], order: str) -> None:
    """Every turn, ``bulk`` (one ``add_turns`` per conversation) or ``live`` (``add_turn`` one
    by one); then each question's evidence is resolved to turn ids."""
    for d in dialogues:
        items = [NewTurn(user_id=d.user_id, session_id=sid, role=role, text=text,
                         at=date + i * TURN_GAP)
                 for sid, date, body in d.sessions for i, (role, text, _) in enumerate(body)]
        if order == "bulk":
            receipts = await mem.add_turns(items)
        else:
            receipts = [await mem.add_turn(it.user_id, it.session_id, it.role, it.text, it.at)
                        for it in items]
        dias = [dia for _, _, body in d.sessions for _, _, dia in body]
        turn_of = {dia: r.turn_id for dia, r in zip(dias, receipts, strict=True)}
        for q in d.questions:
            q.evidence_turn_ids = [turn_of[dia] for dia in q.evidence]


def turns_of(hits: list[Any]) -> list[tuple[str, int]]:
    """(turn id, whitespace tokens returned up to and including its hit), in rank order, each
    turn once: a hit stands for its ``turn_ids``."""
    out, seen, tokens = [], set(), 0
    for hit in hits:
        tokens += len(hit.text.split())
        for turn_id in hit.turn_ids:
            if turn_id not in seen:
                seen.add(turn_id)
                out.append((turn_id, tokens))
    return out


def recall_at(turns: list[tuple[str, int]], evidence: list[str], k: int) -> float:
    return len({t for t, _ in turns[:k]} & set(evidence)) / len(evidence)


def within_tokens(turns: list[tuple[str, int]], evidence: list[str], budget: int) -> float:
    return len({t for t, used in turns if used <= budget} & set(evidence)) / len(evidence)


KS = (5, 10, 20, 50)
BUDGETS = (500, 1000)
# name -> (legs, kinds): legs of the retrieval pipeline, kinds of memory it may return.
MODES: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...] | None]] = {
    "bm25 only": (("bm25",), ("turn",)),
    "vectors only": (("vector",), ("turn",)),
    "fused": (("bm25", "vector"), ("turn",)),
    "entity leg only": (("entity",), None),
    "turns only": (None, ("turn",)),
    "full pipeline": (None, None),
}


async def run_mode(mem: Engine, mode: str, user_id: str, query: str, limit: int) -> list[Any]:
    """The hits one mode returns: ``Engine.recall``, over every leg (the full pipeline) or
    with the other legs switched off (``legs``), over every kind or turns only."""
    legs, kinds = MODES[mode]
    return await mem.recall(user_id, query, limit=limit, kinds=list(kinds) if kinds else None,
                            legs=list(legs) if legs else None)


def columns() -> list[str]:
    return [f"R@{k}" for k in KS] + [f"@{b} tok" for b in BUDGETS]


def measure(turns: list[tuple[str, int]], evidence: list[str]) -> dict[str, float]:
    row = {f"R@{k}": recall_at(turns, evidence, k) for k in KS}
    row.update({f"@{b} tok": within_tokens(turns, evidence, b) for b in BUDGETS})
    return row


async def evaluate(mem: Engine, questions: list[QA], modes: list[str], limit: int = max(KS)
                   ) -> dict[str, Any]:
    """Per mode: the mean of every column over all questions, per category, and the mean
    query time in ms."""
    sums: dict[str, dict[str, dict[str, list[float]]]] = {}
    times: dict[str, list[float]] = {}
    for q in questions:
        for mode in modes:
            start = time.perf_counter()
            hits = await run_mode(mem, mode, q.user_id, q.text, limit)
            times.setdefault(mode, []).append(time.perf_counter() - start)
            row = measure(turns_of(hits), q.evidence_turn_ids)
            for group in ("all", q.category):
                cell = sums.setdefault(mode, {}).setdefault(group, {})
                for name, value in row.items():
                    cell.setdefault(name, []).append(value)
    out: dict[str, Any] = {}
    for mode, groups in sums.items():
        out[mode] = {group: {name: sum(v) / len(v) for name, v in cell.items()}
                     | {"n": len(next(iter(cell.values())))} for group, cell in groups.items()}
        out[mode]["query_ms"] = 1e3 * sum(times[mode]) / len(times[mode])
    return out
