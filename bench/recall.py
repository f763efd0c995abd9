"""Retrieval benchmark: quality (recall@k, recall within a token budget) and latency at scale.

    python bench/recall.py quality                     # ~10 min: LoCoMo dev + generated, both orders
    python bench/recall.py quality --set locomo --order bulk    # ~2 min
    python bench/recall.py quality --data /path/to/quality      # a copy of the LoCoMo dev split
    python bench/recall.py latency                     # 10k and 100k memories in one user, ~6 min
    python bench/recall.py latency --across-users 1000000 --memories   # 1M over 1,000 users
    nice python bench/recall.py latency --memories 100000 --long-term  # layer on, ~25 min

quality: two sets of conversations go through the engine with the real model, each in two
ingest orders (``bulk``: the whole history with ``add_turns``; ``live``: ``add_turn`` one turn
at a time, as a bot sees it), and every question's evidence turns are looked for in the results
of each mode: BM25 only, vectors only, the two fused, the entity leg alone, the full pipeline
over turns only, and the full pipeline (``Engine.recall``) over every kind. A hit counts for the
turns it stands for (an episode its covered turns, a fact its source turns), de-duplicated in
rank order: recall@k over the first k turns, and within 500 / 1,000 whitespace tokens of the
returned text. Per mode, per question category, and the mean query time; then ``recall`` at
limit 10 over turns only and over every kind on the same store, interleaved (p50, p99, ratio).

- LoCoMo's development split (3 conversations, 1,451 turns, 383 questions with evidence,
  adversarial ones left out), measured as its README says (see bench/locomo.py). The data is
  not in the project: ``--data DIR``, else ``$ENGRAM_QUALITY_DIR``, else ``shared/quality``
  beside the checkout; without it the generated set is measured alone, and the bench says so.
- bench/convgen.py's harder set: 720 turns per user, both speakers named in every turn,
  paraphrased questions, two-turn questions. Also: for questions whose answer was updated
  later, whether ``retrieve_memory``'s semantic section (the facts) names the new value first
  and whether it shows the old one; and hnswlib's recall@10 against exact search on this
  corpus's real embeddings, with the AnnIndex's own graph parameters.

latency: ``Engine.recall`` end to end, query embedding included (distinct queries, so the
query cache never answers), at 10k and 100k memories in one user and with 1M memories across
users. At 100k the engine is then closed (saving the graph) and reopened: the time to the
first answer and the latency after the restart. The corpus vectors are mixtures of three real
embeddings of generated turns plus a little noise (embedding 1M texts on this machine would
take hours), given to the turns by the embedding backend the engine is opened with
(``Mixtures``), so they reach the store and the index through the engine's own background
lane; the query is embedded for real. At 100k the user is measured twice: on the exact scan
that serves while the hnswlib graph is built (``stats().vector_graphs_behind``), and on the
graph; then an hnswlib graph with the AnnIndex's parameters over the same vectors against exact
search (recall@10). With ``--long-term`` the long-term layer runs too: the engine's own
followers make episodes, facts and entities of the turns as they are written (most of the hour
goes there); the episodes and facts are embedded for real; then recall over turns only and over
every kind are timed interleaved on that store.

Prints tables and writes JSON (--out, default bench/results/recall-<what>.json).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hnswlib
import locomo
import numpy as np
import trio
from _report import percentiles, progress, write_results
from convgen import CITIES, FOODS, generate

from actors.ann_index import HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH, HNSW_M, HNSW_THRESHOLD
from actors.embedder import MODELS, model_for_store
from engine import Engine, NewTurn, OnnxEmbedder


def _values_in(text: str) -> list[str]:
    """The cities and foods a text names, in order of appearance."""
    low = text.lower()
    found = [(low.find(v.lower()), v) for v in CITIES + FOODS if v.lower() in low]
    return [v for _, v in sorted(found)]


async def updated_facts(mem: Engine, questions) -> dict[str, float]:
    """For questions whose answer changed later: does the semantic section (facts) give the
    new value first, and does the old one appear at all?"""
    first, stale, total = 0, 0, 0
    for q in questions:
        if q.kind != "updated":
            continue
        total += 1
        history = [h for h in (await mem.fact_history(q.user_id, "identity", "location")
                               + await mem.fact_history(q.user_id, "preference",
                                                        "favourite food"))]
        new = _values_in(q.evidence_text)[0]
        old = {v for h in history if h.status == "superseded" for v in _values_in(h.value)}
        raw = await mem.retrieve_memory_raw(q.user_id, q.text, semantic_limit=5)
        named = [_values_in(item.fact) for item in raw.semantic]
        top = next((values for values in named if values), [])
        first += bool(top) and top[0] == new
        stale += any(v in old - {new} for values in named for v in values)
    return {"new value first": first / total, "old value shown": stale / total,
            "questions": total}


def generated_set(users: int, seed: int):
    """convgen's harder set as dialogues (evidence by "session:index") and its questions."""
    conversations, questions = generate(users=users, seed=seed, hard=True)
    texts = {(c.user_id, sid, i): text for c in conversations
             for sid, _, body in c.sessions for i, (_, text) in enumerate(body)}
    dialogues = []
    for c in conversations:
        qas = [locomo.QA(q.user_id, q.text, q.kind, [f"{s}:{i}" for s, i, _ in q.evidence])
               for q in questions if q.user_id == c.user_id]
        sessions = [(sid, begin, [(role, text, f"{sid}:{i}")
                                  for i, (role, text) in enumerate(body)])
                    for sid, begin, body in c.sessions]
        dialogues.append(locomo.Dialogue(c.user_id, {}, sessions, qas))
    for q in questions:
        q.evidence_text = texts[(q.user_id, *q.evidence[-1][:2])]
    return dialogues, conversations, questions


async def quality(args: argparse.Namespace) -> dict[str, Any]:
    sets: list[tuple[str, list[locomo.Dialogue]]] = []
    if args.set in ("locomo", "both"):
        folder = locomo.find_data(args.data)
        if folder is None:
            message = ("LoCoMo dev split not found: pass --data DIR or set ENGRAM_QUALITY_DIR "
                       f"to a folder holding {locomo.FILE}")
            if args.set == "locomo":
                raise SystemExit(message)
            print(f"{message}; measuring the generated set only")
        else:
            sets.append(("locomo", locomo.load(folder)))
    generated: tuple[Any, Any] | None = None
    if args.set in ("generated", "both"):
        dialogues, conversations, questions = generated_set(args.users, args.seed)
        generated = (conversations, questions)
        sets.append(("generated", dialogues))
    orders = ("bulk", "live") if args.order == "both" else (args.order,)
    results: dict[str, Any] = {}
    for name, dialogues in sets:
        questions = [q for d in dialogues for q in d.questions]
        turns = sum(len(body) for d in dialogues for _, _, body in d.sessions)
        for order in orders:
            print(f"\n{name}, {order} ingest: {len(dialogues)} conversations, {turns:,} turns, "
                  f"{len(questions)} questions; ingesting and embedding...", flush=True)
            path = Path(tempfile.mkdtemp(prefix="engram-bench-")) / "store"
            config = ({"consolidate_on_new_session": args.consolidate_on_switch}
                      if args.consolidate_on_switch is not None else None)
            async with Engine.open(path, config=config) as mem:
                start = time.perf_counter()
                await locomo.ingest(mem, dialogues, order)
                await mem.flush()
                row: dict[str, Any] = {"turns": turns, "questions": len(questions),
                                       "ingest_and_index_s": time.perf_counter() - start}
                episodes = facts = 0
                for d in dialogues:
                    episodes += len(await mem.episodes(d.user_id))
                    facts += len(await mem.profile(d.user_id))
                row["long_term"] = {"episodes": episodes, "active_facts": facts}
                row["modes"] = await locomo.evaluate(mem, questions, list(locomo.MODES))
                row["latency_limit_10"] = await layer_latency(mem, questions)
                if generated is not None and name == "generated" and order == orders[0]:
                    conversations, plain = generated
                    for q, qa in zip(plain, questions, strict=True):
                        q.evidence_turn_ids = qa.evidence_turn_ids
                    row["updated_facts"] = await updated_facts(mem, plain)
                    row["hnsw_recall@10"] = await hnsw_recall(mem, conversations, plain)
            results[f"{name}/{order}"] = row
            report(name, order, row)
    return results


async def layer_latency(mem: Engine, questions) -> dict[str, Any]:
    """``recall`` at limit 10 over turns only and over every kind, on the same store, the two
    interleaved question by question (so load on the machine falls on both alike); each query
    text is new to the embedding cache (a trailing space per mode)."""
    times: dict[str, list[float]] = {"turns only": [], "full pipeline": []}
    for i, q in enumerate(questions):
        modes = [("turns only", ["turn"], " "), ("full pipeline", None, "  ")]
        for mode, kinds, pad in (modes if i % 2 else modes[::-1]):
            start = time.perf_counter()
            await mem.recall(q.user_id, q.text + pad, limit=10, kinds=kinds)
            times[mode].append(time.perf_counter() - start)
    out: dict[str, Any] = {mode: percentiles(ts, 1e3, "ms") for mode, ts in times.items()}
    out["p50_ratio"] = out["full pipeline"]["p50_ms"] / out["turns only"]["p50_ms"]
    return out


def report(name: str, order: str, row: dict[str, Any]) -> None:
    cols = locomo.columns()
    modes = row["modes"]
    print(f"{name}, {order}: {row['long_term']['episodes']} episodes, "
          f"{row['long_term']['active_facts']} active facts")
    print(f"{'mode':<17}" + "".join(f"{c:>10}" for c in cols) + f"{'query ms':>10}")
    for mode, cell in modes.items():
        print(f"{mode:<17}" + "".join(f"{cell['all'][c]:>10.3f}" for c in cols)
              + f"{cell['query_ms']:>10.1f}")
    groups = [g for g in modes["full pipeline"] if g not in ("all", "query_ms")]
    print("R@10 by category  " + "".join(f"{g[:12]:>13}" for g in groups))
    for mode, cell in modes.items():
        print(f"{mode:<17} " + "".join(f"{cell[g]['R@10']:>8.3f} n={cell[g]['n']:<3}"
                                       for g in groups))
    lat = row["latency_limit_10"]
    print("recall at limit 10, same store: " + "; ".join(
        f"{mode} p50 {lat[mode]['p50_ms']:.1f} ms p99 {lat[mode]['p99_ms']:.1f} ms"
        for mode in ("turns only", "full pipeline")) + f"; p50 ratio {lat['p50_ratio']:.2f}")
    if "updated_facts" in row:
        up = row["updated_facts"]
        print(f"updated facts ({up['questions']} questions): new value first in the semantic "
              f"section {up['new value first']:.2f}, old value shown {up['old value shown']:.2f}")
        print(f"hnswlib recall@10 against exact search on the corpus's distinct real "
              f"embeddings (ann-benchmarks' definition): {row['hnsw_recall@10']:.3f}")


async def hnsw_recall(mem: Engine, conversations, questions) -> float:
    """The AnnIndex's graph parameters over the corpus's turns, embedded by the engine's
    model, against exact search."""
    # The generator repeats its small-talk lines verbatim; HNSW graphs degrade on mass
    # duplicates (and exact top-k is then all ties), so the check runs on distinct texts.
    texts = sorted({text for c in conversations for _, _, body in c.sessions
                    for _, text in body})
    matrix = await mem.embed(texts)
    queries = await mem.embed([q.text for q in questions])
    return graph_recall(matrix, queries)


def recall_at_k(queries: np.ndarray, matrix: np.ndarray, labels: np.ndarray, k: int) -> float:
    """ann-benchmarks' recall: a returned neighbour counts when its true similarity is within
    1e-3 of the k-th best true similarity, so exact ties (repeated texts) are not misses."""
    true = queries @ matrix.T
    kth = -np.sort(-true, axis=1)[:, k - 1]
    got = np.take_along_axis(true, np.asarray(labels)[:, :k], axis=1)
    return float(np.mean((got >= kth[:, None] - 1e-3).sum(axis=1) / k))


# -- latency -------------------------------------------------------------------------------------


async def corpus_pool(seed: int) -> tuple[list[str], np.ndarray, list[str]]:
    """Real texts and their real embeddings (the pool), and distinct query texts."""
    conversations, questions = generate(users=200, sessions=12, turns=20, seed=seed)
    texts = sorted({t for c in conversations for _, _, body in c.sessions for _, t in body})
    path = Path(tempfile.mkdtemp(prefix="engram-pool-")) / "store"
    async with Engine.open(path, config={"background_embedding": False}) as mem:
        vectors = await mem.embed(texts)
    rng = random.Random(seed)
    names = ["Clara", "Jonas", "Mei", "Tariq", "my sister", "my dog", "the flat", "work"]
    queries = sorted({q.text for q in questions})
    queries = [f"{q} {rng.choice(names)} {i}" for i, q in enumerate(queries * 30)][:300]
    return texts, vectors, queries


class Mixtures:
    """The embedding backend of the latency runs (``Engine.open(embedder=...)``): a turn the
    bench generated (a pool text, then `` (#n)``) gets a mixture of three of the pool's real
    embeddings plus a little noise, spread over the model's space like distinct memories are,
    not 183 tight clusters of near-copies; embedding 1M texts on this machine would take
    hours. The mixture is drawn from a seed and the text alone, so a text has the same vector
    whenever it is asked for. Every other text (the queries, the episodes and facts of
    ``--long-term``) is embedded for real by the model the pool came from."""

    def __init__(self, texts: list[str], pool: np.ndarray, seed: int,
                 model: str | None = None) -> None:
        self.real = OnnxEmbedder(model)  # None: what a new store gets on this machine
        self.model_id, self.dim = self.real.model_id, self.real.dim
        self.index = {text: i for i, text in enumerate(texts)}
        self.pool = pool
        self.seed = seed

    def load(self) -> None:
        self.real.load()

    def count_tokens(self, texts: list[str]) -> list[int]:
        return self.real.count_tokens(texts)

    def mixture(self, text: str) -> np.ndarray | None:
        """A generated turn's vector (None: not one of the bench's turns)."""
        base, mark, tail = text.rpartition(" (#")
        j = self.index.get(base) if mark and tail.endswith(")") else None
        if j is None:
            return None
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        rng = np.random.default_rng([self.seed, int.from_bytes(digest, "big")])
        mix = rng.integers(0, len(self.pool), 2)
        vector = (self.pool[j] + 0.7 * self.pool[mix[0]] + 0.4 * self.pool[mix[1]]
                  + rng.normal(0, 0.02, self.dim))
        return (vector / np.linalg.norm(vector)).astype(np.float32)

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        real = []
        for row, text in enumerate(texts):
            vector = self.mixture(text)
            if vector is None:
                real.append(row)
            else:
                out[row] = vector
        if real:
            out[real] = self.real.encode([texts[row] for row in real])
        return out


async def load_user(mem: Engine, user_id: str, n: int, texts: list[str],
                    rng: np.random.Generator, first_at) -> list[str]:
    """n turns for a user, each a pool text made distinct; the engine's background lane
    embeds them through :class:`Mixtures`. Returns their texts."""
    picks = rng.integers(0, len(texts), n)
    added = []
    for at in range(0, n, 4096):
        chunk = picks[at : at + 4096]
        items = [NewTurn(user_id=user_id, session_id=f"s{(at + i) // 50}", role="user",
                         text=f"{texts[j]} (#{at + i})", at=first_at) for i, j in enumerate(chunk)]
        await mem.add_turns(items)
        added += [item.text for item in items]
    return added


async def caught_up(mem: Engine) -> None:
    """Wait until both indexes hold everything logged so far (``stats``: the text index's
    and the vectors' positions), without waiting for the long-term layer as ``flush`` does."""
    target = (await mem.stats()).last_lsn
    while True:
        stats = await mem.stats()
        if stats.indexed_lsn >= target and stats.embedded_lsn >= target:
            return
        await trio.sleep(0.1)


async def graphs_built(mem: Engine) -> None:
    """Wait until no user's vector graph is being built or behind its rows (``stats``)."""
    while (await mem.stats()).vector_graphs_behind:
        await trio.sleep(0.2)


async def derived(mem: Engine, user_id: str) -> dict[str, int]:
    """The episodes and active facts the long-term layer made of the user's turns."""
    return {"episodes": len(await mem.episodes(user_id)),
            "active_facts": len(await mem.profile(user_id))}


async def time_pair(mem: Engine, users: list[str], queries: list[str]) -> dict[str, Any]:
    """``recall`` over turns only and over every kind (the full pipeline, the long-term
    layer's episodes and facts included), interleaved query by query so load on the machine
    falls on both alike; each query text is new to the embedding cache in each mode.

    Beside the wall-clock p50 ratio, the ratio of the p50s of the process's CPU time per
    query (every thread's: the model's, the searches', the reads'): on a shared machine whose
    load average is many times its cores, wall time is mostly waiting for a core, and the
    CPU-time ratio says what the extra work costs. It counts every thread of the process, so
    it holds only while nothing else runs in it: not in the exact-scan phase, where a graph
    is being built on one of its threads."""
    times: dict[str, list[float]] = {"turns only": [], "full pipeline": []}
    cpu: dict[str, list[float]] = {"turns only": [], "full pipeline": []}
    for i, query in enumerate(queries):
        modes = [("turns only", ["turn"], " "), ("full pipeline", None, "  ")]
        for mode, kinds, pad in (modes if i % 2 else modes[::-1]):
            start, used = time.perf_counter(), time.process_time()
            await mem.recall(users[i % len(users)], query + pad, limit=10, kinds=kinds)
            times[mode].append(time.perf_counter() - start)
            cpu[mode].append(time.process_time() - used)
    out: dict[str, Any] = {mode: percentiles(ts, 1e3, "ms") for mode, ts in times.items()}
    out["p50_ratio"] = out["full pipeline"]["p50_ms"] / out["turns only"]["p50_ms"]
    out["cpu_p50_ratio"] = (float(np.median(cpu["full pipeline"]))
                            / float(np.median(cpu["turns only"])))
    return out


def put_timing(row: dict[str, Any], key: str, timed: dict[str, Any]) -> None:
    """One timing into a result row; a pair (``time_pair``) as the full pipeline under
    ``key``, turns-only under ``key, turns only`` and their p50 ratio, so every distribution
    stays a flat entry of the row (as the report's pictures read them)."""
    if "p50_ratio" not in timed:
        row[key] = timed
        return
    row[key] = timed["full pipeline"]
    row[f"{key}, turns only"] = timed["turns only"]
    row[f"{key}, p50 ratio"] = timed["p50_ratio"]
    row[f"{key}, cpu p50 ratio"] = timed["cpu_p50_ratio"]


def _line(row: dict[str, Any]) -> str:
    parts = []
    for k, v in row.items():
        if isinstance(v, dict) and "p50_ms" in v:
            parts.append(f"{k} p50 {v['p50_ms']:.1f} ms p99 {v['p99_ms']:.1f} ms")
        elif k.endswith("p50 ratio"):
            parts.append(f"{k} {v:.2f}")
    return "; ".join(parts)


async def time_queries(mem: Engine, users: list[str], queries: list[str]) -> dict[str, float]:
    latencies = []
    for i, query in enumerate(queries):
        user = users[i % len(users)]
        start = time.perf_counter()
        await mem.recall(user, query, limit=10)
        latencies.append(time.perf_counter() - start)
    return percentiles(latencies, 1e3, "ms")


async def time_threads(mem: Engine, backend: Mixtures, users: list[str], queries: list[str]
                       ) -> dict[str, Any]:
    """``recall`` with the query embedded on one onnxruntime thread and on two
    (``embed_threads=2``: the caller and a helper at nice 19), interleaved query by query in
    this process, so the machine's drift falls on both alike; wall and CPU p50 of each."""
    variant = next(name for name, (_, model_id) in MODELS.items()
                   if model_id == backend.real.model_id)
    engine_model = backend.real
    models = {"one thread": OnnxEmbedder(variant, threads=1),
              "two threads": OnnxEmbedder(variant, threads=2)}
    for model in models.values():
        await trio.to_thread.run_sync(model.load)
    times: dict[str, list[float]] = {mode: [] for mode in models}
    cpu: dict[str, list[float]] = {mode: [] for mode in models}
    try:
        for i, query in enumerate(queries):
            for mode in (list(models) if i % 2 else list(models)[::-1]):
                backend.real = models[mode]
                start, used = time.perf_counter(), time.process_time()
                await mem.recall(users[i % len(users)], f"{query} ({mode})", limit=10)
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - used)
    finally:
        backend.real = engine_model
    out: dict[str, Any] = {}
    for mode in models:
        out[mode] = percentiles(times[mode], 1e3, "ms")
        out[mode]["cpu_p50_ms"] = float(np.median(cpu[mode])) * 1e3
    return out


async def latency(args: argparse.Namespace) -> dict[str, Any]:
    texts, pool, queries = await corpus_pool(args.seed)
    print(f"latency: pool of {len(texts)} real embeddings, {len(queries)} distinct queries")
    rng = np.random.default_rng(args.seed)
    first_at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    # The queries are embedded by the model the store's vectors came from (a reused store's),
    # or by what a new store gets here.
    model = model_for_store(Path(args.reuse)) if args.reuse else None
    backend = Mixtures(texts, pool, args.seed, model)
    results: dict[str, Any] = {}
    if args.reuse:
        row = await measure_reused(Path(args.reuse), queries, backend)
        results[f"one_user_{row['vectors']}"] = row
        return results
    # The turns' vectors come from Mixtures through the engine's own background lane (embedding
    # 100k turns for real would take hours here). Without --long-term the long-term layer is
    # off: index scale alone (the entity leg still runs, on an empty registry). With it the
    # engine's own followers make episodes, facts and entities of the turns as they are
    # written (the summariser's sentence vectors come from the embedder's content cache: the
    # corpus repeats its texts), the background lane embeds the episodes and facts for real,
    # and turns-only and full recall are timed interleaved on that store.
    layer = args.long_term
    config = {"long_term": layer}
    timing = time_pair if layer else time_queries
    for n in args.memories:
        path = Path(tempfile.mkdtemp(prefix="engram-lat-")) / "store"
        async with Engine.open(path, config=config, embedder=backend) as mem:
            start = time.perf_counter()
            added = await load_user(mem, "big", n, texts, rng, first_at)
            await caught_up(mem)
            setup = time.perf_counter() - start
            row: dict[str, Any] = {"setup_s": setup}
            if layer:
                start = time.perf_counter()
                await mem.flush()  # the long-term layer has taken in every turn, embedded
                row["long_term_s"] = time.perf_counter() - start
                row["long_term"] = await derived(mem, "big")
                print(f"  {n:,} turns: {row['long_term']}, made and embedded in "
                      f"{row['long_term_s']:.0f} s; the store stays at {path} "
                      f"(measure it again with --reuse {path})", flush=True)
            await mem.recall("big", "warm up the index", limit=10)
            if n >= HNSW_THRESHOLD:
                put_timing(row, "exact_scan", await timing(mem, ["big"], queries[:100]))
                start = time.perf_counter()
                await graphs_built(mem)
                row["graph_build_s"] = time.perf_counter() - start
                put_timing(row, "graph", await timing(mem, ["big"], queries[100:]))
                if args.compare_threads:
                    for mode, timed in (await time_threads(mem, backend, ["big"],
                                                           queries[100:])).items():
                        row[f"graph, query on {mode}"] = timed
                # The turns' vectors as stored (float16), and the queries as the engine embeds them.
                stored = np.stack([backend.mixture(t) for t in added]).astype(np.float16)
                row["graph_recall@10"] = graph_recall(stored.astype(np.float32),
                                                      await mem.embed(queries[:100]))
            else:
                put_timing(row, "exact_scan", await timing(mem, ["big"], queries))
        if n >= HNSW_THRESHOLD:  # closing saved the graph; a restart reuses it
            start = time.perf_counter()
            async with Engine.open(path, config=config, embedder=backend) as mem:
                await mem.recall("big", queries[0], limit=10)
                row["restart_first_answer_s"] = time.perf_counter() - start
                put_timing(row, "after_restart", await timing(mem, ["big"], queries[1:101]))
        results[f"one_user_{n}"] = row
        print(f"  {n:>9,} memories in one user: " + _line(row))
    if args.across_users:
        total, per = args.across_users, 1000
        users = [f"u{i:05d}" for i in range(total // per)]
        path = Path(tempfile.mkdtemp(prefix="engram-lat-")) / "store"
        async with Engine.open(path, config=config, embedder=backend) as mem:
            start = time.perf_counter()
            for i, user in enumerate(users):
                await load_user(mem, user, per, texts, rng, first_at)
                if i % 100 == 99 or i == len(users) - 1:
                    progress("loading", (i + 1) * per, total)
            await caught_up(mem)
            row = {"setup_s": time.perf_counter() - start}
            print(f"  loaded and indexed in {row['setup_s']:.0f} s")
            sample = random.Random(args.seed).sample(users, 150)
            row["cold_users"] = await time_queries(mem, sample, queries[:150])
            row["warm_users"] = await time_queries(mem, sample, queries[150:])
            results[f"across_users_{total}"] = row
            print(f"\n  {total:,} memories over {len(users):,} users: " + "; ".join(
                f"{k} p50 {v['p50_ms']:.1f} ms p99 {v['p99_ms']:.1f} ms" for k, v in row.items()
                if isinstance(v, dict)))
    return results


async def measure_reused(path: Path, queries: list[str], backend: Mixtures) -> dict[str, Any]:
    """A store a ``--long-term`` run left behind (stopped before its followers caught up: the
    fact extractor is the slow one), measured as it is: opened with the followers off, what
    the background lane had not embedded yet (its episodes and active facts, for real)
    embedded, then turns-only and full recall interleaved on the graph."""
    async with Engine.open(path, config={"long_term": False}, embedder=backend) as mem:
        start = time.perf_counter()
        await caught_up(mem)
        row: dict[str, Any] = {"long_term": await derived(mem, "big")}
        row["long_term_embed_s"] = time.perf_counter() - start
        await mem.recall("big", "warm up the index", limit=10)
        counts = await mem.memory_stats("big")
        row["vectors"] = counts["turns"] + counts["episodes"] + counts["facts"]
        print(f"  reused store: {row['vectors']:,} vectors, {row['long_term']}", flush=True)
        await graphs_built(mem)
        put_timing(row, "graph", await time_pair(mem, ["big"], queries[100:]))
    print("  " + _line(row))
    return row


def graph_recall(matrix: np.ndarray, queries: np.ndarray) -> float:
    """An hnswlib graph with the AnnIndex's own parameters (M, ef_construction, ef_search)
    over ``matrix``, against exact search over the same rows (ann-benchmarks' recall@10)."""
    graph = hnswlib.Index(space="ip", dim=matrix.shape[1])
    graph.init_index(max_elements=len(matrix), M=HNSW_M, ef_construction=HNSW_EF_CONSTRUCTION)
    graph.set_num_threads(1)
    graph.add_items(matrix, np.arange(len(matrix)))
    graph.set_ef(HNSW_EF_SEARCH)
    labels, _ = graph.knn_query(queries, k=10)
    return recall_at_k(queries, matrix, labels, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("quality", "latency"))
    parser.add_argument("--users", type=int, default=8, help="quality: generated users")
    parser.add_argument("--set", choices=("locomo", "generated", "both"), default="both",
                        help="quality: which conversations")
    parser.add_argument("--order", choices=("bulk", "live", "both"), default="both",
                        help="quality: ingest order")
    parser.add_argument("--data", default=None,
                        help="quality: folder holding locomo-dev.json (default: "
                             "$ENGRAM_QUALITY_DIR, else shared/quality beside the checkout)")
    parser.add_argument("--memories", type=int, nargs="*", default=[10_000, 100_000])
    parser.add_argument("--across-users", type=int, default=0)
    parser.add_argument("--reuse", default=None,
                        help="latency: measure the store a stopped --long-term run left "
                             "(printed as engram-lat-*/store) as it is, followers off")
    parser.add_argument("--long-term", action="store_true",
                        help="latency: the long-term layer on (episodes, facts, entities made "
                             "by the engine's followers); turns-only and full timed interleaved")
    parser.add_argument("--consolidate-on-switch", default=None,
                        action=argparse.BooleanOptionalAction,
                        help="quality: Config.consolidate_on_new_session on or off (default: "
                             "the engine's default)")
    parser.add_argument("--compare-threads", action="store_true",
                        help="latency: also time recall on the graph with the query embedded "
                             "on one onnxruntime thread and on two, interleaved")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"seed {args.seed}; {os.cpu_count()} cores")
    results = trio.run(quality if args.what == "quality" else latency, args)
    results.update(cores=os.cpu_count(), seed=args.seed,
                   consolidate_on_switch=args.consolidate_on_switch)
    write_results(args.out or f"bench/results/recall-{args.what}.json", results,
                  f"recall-{args.what}")


if __name__ == "__main__":
    sys.exit(main())
