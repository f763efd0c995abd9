"""A memory's link neighbourhood as a small graph, laid out for inline SVG drawn server-side.

Breadth-first along ``Engine.links`` (both directions, as recall follows them), up to a depth
and a node count; the start in the middle, each further hop on a wider ring. The template
draws it; every label goes through the template's autoescaping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import Engine

__all__ = ["Graph", "neighbourhood"]

MAX_NODES = 40  # beyond this a ring is unreadable on a phone; the page says the graph was cut
SIZE = 360  # the SVG's viewBox side; it scales to the page's width
RING = 70  # distance between rings
LABEL = 28  # characters of a memory's text under its node


@dataclass
class Node:
    id: str
    kind: str
    label: str  # under the node: the text's start (or the id)
    text: str  # on hover: the whole text
    hop: int
    x: float = 0.0
    y: float = 0.0


@dataclass
class Edge:
    source: Node
    target: Node
    type: str

    @property
    def middle(self) -> tuple[float, float]:
        return (self.source.x + self.target.x) / 2, (self.source.y + self.target.y) / 2


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    cut: bool = False  # more memories were reachable than MAX_NODES
    size: int = SIZE


class _Describer:
    """(kind, short text) of a memory, read through the public API; a user's facts and
    episodes are read once, when the first one is met."""

    def __init__(self, engine: Engine, user_id: str) -> None:
        self.engine = engine
        self.user_id = user_id
        self.derived: dict[str, tuple[str, str]] | None = None

    async def __call__(self, memory_id: str) -> tuple[str, str]:
        engine, user_id = self.engine, self.user_id
        turn = await engine.get_turn(user_id, memory_id)
        if turn is not None:
            return "turn", turn.text
        note = await engine.get_note(user_id, memory_id)
        if note is not None:
            return "note", note.text
        if self.derived is None:
            self.derived = {f.fact_id: ("fact", f"{f.category}/{f.key} = {f.value}")
                            for f in await engine.fact_versions(user_id)}
            self.derived.update((e.episode_id, ("episode", e.title))
                                for e in await engine.episodes(user_id))
        return self.derived.get(memory_id, ("memory", ""))


async def neighbourhood(engine: Engine, user_id: str, start: str, depth: int) -> Graph:
    """The memories within ``depth`` links of ``start`` and the typed links between them.

    Raises:
        InvalidInput: a bad user or memory id.
    """
    graph = Graph()
    nodes: dict[str, Node] = {}
    describe = _Describer(engine, user_id)

    async def add(memory_id: str, hop: int) -> Node:
        kind, text = await describe(memory_id)
        label = text if len(text) <= LABEL else text[: LABEL - 1] + "…"
        node = nodes[memory_id] = Node(memory_id, kind, label or memory_id, text, hop)
        graph.nodes.append(node)
        return node

    await add(start, 0)
    frontier = [start]
    seen_edges: set[tuple[str, str, str]] = set()
    for hop in range(1, depth + 1):
        following = []
        for memory_id in frontier:
            for link in await engine.links(user_id, memory_id):
                other = link.to_id if link.from_id == memory_id else link.from_id
                if other not in nodes:
                    if len(nodes) >= MAX_NODES:
                        graph.cut = True
                        continue
                    await add(other, hop)
                    following.append(other)
                key = (link.from_id, link.to_id, link.type)
                if key not in seen_edges:
                    seen_edges.add(key)
                    graph.edges.append(Edge(nodes[link.from_id], nodes[link.to_id], link.type))
        frontier = following
    _lay_out(graph)
    return graph


def _lay_out(graph: Graph) -> None:
    centre = SIZE / 2
    rings: dict[int, list[Node]] = {}
    for node in graph.nodes:
        rings.setdefault(node.hop, []).append(node)
    deepest = max(rings)
    ring = min(RING, (SIZE / 2 - 30) / deepest) if deepest else RING
    for hop, members in rings.items():
        for i, node in enumerate(members):
            angle = 2 * math.pi * i / len(members) - math.pi / 2 + hop * 0.4
            node.x = round(centre + hop * ring * math.cos(angle), 1)
            node.y = round(centre + hop * ring * math.sin(angle), 1)
