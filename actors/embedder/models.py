"""The embedding models: which model a store runs, where its files live, and the backends that
run it, behind the Embedder actor (``embedder.py``).

Backends (``encode(texts) -> array``, called from the actor's lanes at once, so it must be
thread-safe, as an onnxruntime session is):

- :class:`OnnxEmbedder`: all-MiniLM-L6-v2 as built by native_models/build.py, onnxruntime on one
  intra-op thread by default (more: the caller, the actor's own long-lived thread, and
  helpers at nice 19 that do not spin) and one inter-op thread, tokenised
  with ``tokenizers``' ``encode_batch`` (truncation at 256 tokens, padding to the longest text
  in the batch).
- :class:`HashEmbedder`: deterministic feature hashing, for tests that are not about
  embeddings: texts sharing words get similar vectors, and nothing needs the model.

A store keeps the model its vectors came from (:func:`model_for_store`); a checkout finds the
built model in native_models/, an installed package in the per-user data directory
(:func:`default_model_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import lmdb
import numpy as np
import outcome

from ..base.errors import EngineError, ModelMissing
from ..store import stored_model

# The Rust tokenizer's own thread pool would compete with onnxruntime and the trio thread for
# 2 cores; the actor already runs it off the loop. Set before the first encode; a caller's own
# setting wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# onnxruntime intra-op threads per call by default. A second (a helper at MODEL_NICE) cut a
# query's embedding, most of a recall here, by 0.6-1.3 ms at the recall's p50 on 2 cores, and
# cost the background follower 12-17% of its rate (bench/recall.py latency --compare-threads,
# bench/embed.py --throughput): the two lanes then share one helper. Config.embed_threads
# chooses.
QUERY_THREADS = 1
# The niceness of the model's background threads and of onnxruntime's helper threads (which
# background batches use too). On 2 cores the model holds one; at the default priority the
# trio thread and the LMDB writer queue behind background inference for CPU time slices, and
# durable add_turn p99 went from 3.3 to 7.3 ms (bench/ingest.py). At 19 the hot path preempts
# it (p99 4.3 ms) and the model still gets the core whenever the hot path is idle.
MODEL_NICE = 19

T = TypeVar("T")

__all__ = ["EmbeddingBackend", "OnnxEmbedder", "HashEmbedder", "AbsentModel", "MODELS",
           "REFERENCE_MODEL", "default_model", "model_for_store", "default_model_dir",
           "build_target", "user_model_dir", "CHECKOUT_MODEL_DIR", "MODEL_ENV", "BUILD_COMMAND",
           "MAX_TOKENS"]

MAX_TOKENS = 256  # the model's training length (sentence-transformers max_seq_length)

# A checkout builds into native_models/ beside the packages (python native_models/build.py);
# an installed package has no writable home of its own, so `engram-trio model build` writes to
# the per-user data directory, or wherever MODEL_ENV points.
CHECKOUT_MODEL_DIR = (Path(__file__).resolve().parent.parent.parent / "native_models"
                      / "all-MiniLM-L6-v2")
MODEL_ENV = "ENGRAM_MODEL_DIR"
# Config.model name -> (file in the model directory, model id recorded in the store).
MODELS = {
    "minilm-l6-v2": ("model.onnx", "sentence-transformers/all-MiniLM-L6-v2"),
    "minilm-l6-v2-q8": ("model.q8.onnx", "sentence-transformers/all-MiniLM-L6-v2@q8-block16"),
    "minilm-l6-v2-i8": ("model.i8.onnx", "sentence-transformers/all-MiniLM-L6-v2@i8-dynamic"),
}
BUILD_COMMAND = "engram-trio model build"
PROBE_TEXT = "a probe of the model"


def user_model_dir() -> Path:
    """The per-user data directory's model folder (``~/.local/share/engram-trio/...`` on
    Linux)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("engram-trio")) / "models" / "all-MiniLM-L6-v2"


def build_target() -> Path:
    """Where ``engram-trio model build`` writes by default: ``$ENGRAM_MODEL_DIR`` if set, else
    the per-user data directory."""
    env = os.environ.get(MODEL_ENV)
    return Path(env).expanduser() if env else user_model_dir()


def default_model_dir() -> Path:
    """Where the engine looks when ``Config.model_dir`` is not set: ``$ENGRAM_MODEL_DIR`` if set;
    else a checkout's native_models/ if it holds a model; else the per-user data directory."""
    if os.environ.get(MODEL_ENV):
        return build_target()
    if (CHECKOUT_MODEL_DIR / "tokenizer.json").exists():
        return CHECKOUT_MODEL_DIR
    return user_model_dir()



# The reference model: what a new store gets when its model directory does not say which
# variant is faster on this machine (a build by an older builder, a directory copied in).
REFERENCE_MODEL = "minilm-l6-v2"


def default_model(model_dir: str | Path | None = None) -> str:
    """The :data:`MODELS` name a new store gets: the variant the model's build measured as the
    faster on this machine (``preferred`` in its provenance.json; native_models/build.py says
    how), else :data:`REFERENCE_MODEL`. The variants give the same recall on the LoCoMo dev
    split (bench/embed.py --quality, turns-only vector recall@10 within 0.005 of fp32's), so
    speed decides, and which is faster depends on the processor's 8-bit instructions; the
    build also requires a quantised variant's vectors to stay near fp32's on its machine. A
    store keeps the model it was made with (:func:`model_for_store`), so a build that prefers
    another never strands an existing store."""
    record = (Path(model_dir) if model_dir else default_model_dir()) / "provenance.json"
    try:
        chosen = json.loads(record.read_text()).get("preferred")
    except (OSError, ValueError, AttributeError):
        return REFERENCE_MODEL  # no build yet: the embedder's load says how to make one
    return next((name for name, (file, _) in MODELS.items() if file == chosen), REFERENCE_MODEL)


def model_for_store(path: Path, model_dir: str | Path | None = None) -> str:
    """The :data:`MODELS` name to run on the store at ``path``: the one its vectors came from,
    else (a new store, or vectors from a model this build does not have, which the store then
    refuses with ModelMismatch) :func:`default_model`."""
    if not (path / "data.mdb").is_file():
        return default_model(model_dir)
    try:
        recorded = stored_model(path)
    except (lmdb.Error, EngineError, UnicodeError):
        return default_model(model_dir)  # the store's own open reports what is wrong with it
    for name, (_, model_id) in MODELS.items():
        if recorded is not None and recorded.id == model_id:
            return name
    return default_model(model_dir)


class EmbeddingBackend(Protocol):
    """What the Embedder runs. ``load`` runs once in a worker thread; ``encode`` is called from
    several threads at once and must be thread-safe. A backend may also offer
    ``count_tokens(texts) -> list[int]`` (its own tokenizer's counts), by which the follower
    sorts and cuts its batches; without it, words approximate tokens."""

    model_id: str
    dim: int

    def load(self) -> None: ...

    def encode(self, texts: list[str]) -> np.ndarray: ...


class OnnxEmbedder:
    """all-MiniLM-L6-v2 on onnxruntime.

    Args:
        model: a key of :data:`MODELS` (default: :func:`default_model`, the faster variant on
            this machine).
        model_dir: where the built files are (default: :func:`default_model_dir`).
        threads: onnxruntime intra-op threads: the calling thread and ``threads - 1`` helpers
            (default: QUERY_THREADS). The helpers are made at MODEL_NICE and never spin, so
            they take only a core the hot path leaves idle.
    """

    dim = 384

    def __init__(self, model: str | None = None, model_dir: str | Path | None = None,
                 threads: int | None = None) -> None:
        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        self.file, self.model_id = MODELS[model or default_model(self.model_dir)]
        # The one command that puts the model where this embedder looks.
        self.build_command = (BUILD_COMMAND if model_dir is None
                              or self.model_dir.resolve() == build_target().resolve()
                              else f"{BUILD_COMMAND} --dir {self.model_dir}")
        self.threads = threads or QUERY_THREADS
        self._session = None
        self._tokenizer = None
        self._counter = None
        # The model's vector of PROBE_TEXT once loaded: what the store compares with the one
        # its vectors' files gave (engine/_wiring.py), so other files under the same names
        # (another model, another tokenizer) are refused rather than mixed in.
        self.probe: np.ndarray | None = None

    def load(self) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        path, tokenizer = self.model_dir / self.file, self.model_dir / "tokenizer.json"
        for needed in (path, tokenizer):
            try:
                there = needed.exists()
            except OSError as exc:  # a folder this process may not search
                raise ModelMissing(f"cannot look for the embedding model at {needed}: {exc}; "
                                   "give this process read access to it") from exc
            if not there:
                raise ModelMissing(f"expected the embedding model at {needed}, found nothing; "
                                   f"build it with `{self.build_command}`")
            if needed.is_file() and not os.access(needed, os.R_OK):
                raise ModelMissing(f"cannot read the embedding model's {needed}: permission "
                                   "denied; give this process read access to it (rebuilding "
                                   "would not help)")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3  # shape-merge notices about our dynamic axes are noise
        if self.threads == 1:  # no helper threads to make
            self._session = _open_session(path, options, self.build_command)
        else:
            # A helper that spins between a query's operators holds a core the loop, the
            # searches and the LMDB writer need; a sleeping one wakes within microseconds.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = _at_nice(MODEL_NICE, _open_session, path, options,
                                     self.build_command)
        try:
            tok = Tokenizer.from_file(str(tokenizer))
            counter = Tokenizer.from_file(str(tokenizer))  # same rules, unpadded: counts only
        except Exception as exc:  # the tokenizers library raises bare Exceptions
            raise ModelMissing(f"cannot load {tokenizer}: {exc}; rebuild it with "
                               f"`{self.build_command} --force`") from exc
        tok.enable_truncation(MAX_TOKENS)
        tok.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: pad to the batch's longest
        self._tokenizer = tok
        counter.enable_truncation(MAX_TOKENS)
        # tokenizer.json pads every text to 128 tokens: a count must not include padding.
        counter.no_padding()
        self._counter = counter
        self._check_output(path)

    def _check_output(self, path: Path) -> None:
        """Run the model once: other files under its names (another model, another width,
        vectors not of unit length) are refused here, before a vector of theirs is stored.

        Raises:
            ModelMissing: naming the file and what it gives.
        """
        fix = f"rebuild it with `{self.build_command} --force`"
        try:
            probe = np.asarray(self.encode([PROBE_TEXT]))
        except Exception as exc:  # onnxruntime raises its own types
            raise ModelMissing(f"cannot run {path} on its tokenizer's input: {exc}; {fix}"
                               ) from exc
        if probe.shape != (1, self.dim):
            width = probe.shape[-1] if probe.ndim == 2 else f"shape {probe.shape}"
            raise ModelMissing(f"{path} gives vectors of {width} dimensions where this engine "
                               f"needs {self.dim}: not the model it builds; {fix}")
        length = float(np.linalg.norm(probe))
        if not abs(length - 1.0) < 1e-3:
            raise ModelMissing(f"{path} gives vectors of length {length:.3g} where this engine "
                               f"needs unit vectors: not the model it builds; {fix}")
        self.probe = probe[0].astype(np.float32)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's token count after truncation (no padding): the batching key."""
        return [len(e.ids) for e in self._counter.encode_batch(texts)]

    def fit_chars(self, texts: list[str]) -> list[int]:
        """How many of each text's characters the model's window holds (all of a text that
        fits): where a chunk must end (:mod:`actors.chunking`)."""
        out = []
        for text, e in zip(texts, self._counter.encode_batch(texts), strict=True):
            # Truncated: the window ends after its last token before [SEP] (the counter pads
            # nothing, so offsets[-2] is a token of the text).
            out.append(e.offsets[-2][1] if e.overflowing else len(text))
        return out

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return ids, mask

    def encode(self, texts: list[str]) -> np.ndarray:
        ids, mask = self.tokenize(texts)
        return self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]


def _open_session(path: Path, options: object, build_command: str) -> object:
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf types
        raise ModelMissing(f"cannot load {path}: {exc}; rebuild it with "
                           f"`{build_command} --force`") from exc


def _at_nice(nice: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a new thread at ``nice``, so the threads it starts (onnxruntime's
    intra-op helpers, made with the session) inherit that niceness: Linux keeps it per thread,
    and an unprivileged thread cannot lower it again, so no reused thread may be the one."""
    if sys.platform != "linux":
        return fn(*args)
    box: list[outcome.Outcome] = []

    def run() -> None:
        def niced() -> T:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            return fn(*args)

        box.append(outcome.capture(niced))

    thread = threading.Thread(target=run, name="engram-model-load")
    thread.start()
    thread.join()
    return box[0].unwrap()


class AbsentModel:
    """The store's model, not loaded, for a read-only engine that embeds nothing (a
    snapshot, an export, stats): such a command needs no model files, so a backup never waits
    on a model build. A text given to embed is ModelMissing, with the reason.

    Args:
        model_id / dim: the store's recorded model, which the store checks as it would the
            model's own.
        reason: what ModelMissing says if something does ask for a vector.
    """

    def __init__(self, model_id: str, dim: int, reason: str) -> None:
        self.model_id = model_id
        self.dim = dim
        self.reason = reason

    def load(self) -> None:
        pass

    def encode(self, texts: list[str]) -> np.ndarray:
        raise ModelMissing(self.reason)


_WORD = re.compile(r"\w+")


class HashEmbedder:
    """Deterministic fake: each word hashes to a signed position; the sum is normalised.

    Texts that share words have positive cosine, unrelated texts near zero: enough to test
    everything around embeddings without the model.
    """

    def __init__(self, dim: int = 384, model_id: str = "engram/hash-embedder") -> None:
        self.dim = dim
        self.model_id = model_id
        self.calls: list[int] = []  # batch sizes seen, for tests of batching

    def load(self) -> None:
        pass

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(_WORD.findall(text)) + 2 for text in texts]

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls.append(len(texts))
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in _WORD.findall(text.lower()) or [text]:
                h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
                out[row, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        return out / norms
