"""native_models/build.py: which variant a new store gets is measured on the machine that
builds the model, and recorded beside it."""

from __future__ import annotations

import json

import pytest

from actors.embedder import MODELS, default_model, default_model_dir
from native_models.build import VARIANTS, built, measure, preferred


def speeds(fp32_rate: float, q8_rate: float, fp32_query: float = 5.0,
           q8_query: float = 5.0) -> dict[str, dict[str, float]]:
    return {"model.onnx": {"texts_per_s": fp32_rate, "query_ms": fp32_query},
            "model.q8.onnx": {"texts_per_s": q8_rate, "query_ms": q8_query}}


@pytest.mark.parametrize(("speed", "expected"), [
    (speeds(100, 130), "model.q8.onnx"),  # the machine q8 became the default on: 1.3x
    (speeds(135, 77), "model.onnx"),  # AVX2 without 8-bit dot products: q8 at half the rate
    (speeds(100, 110), "model.onnx"),  # within timing noise: the reference model
    (speeds(100, 130, 5.0, 6.0), "model.onnx"),  # faster in batches, slower for a query
])
def test_q8_is_preferred_only_where_it_is_clearly_faster(speed, expected) -> None:
    """q8 is chosen over fp32 only when its batch rate is clearly higher and one query is no
    slower; where the two are close, fp32 (the reference) stays."""
    assert preferred(speed) == expected


def test_the_build_records_each_variants_speed_and_the_one_new_stores_get() -> None:
    """The set-up's build measured both variants here; its choice follows from the figures
    and is what a new store gets."""
    where = default_model_dir()
    assert built(where)
    provenance = json.loads((where / "provenance.json").read_text())
    assert set(provenance["speed"]) == set(VARIANTS)
    assert all(s["texts_per_s"] > 0 and s["query_ms"] > 0 for s in provenance["speed"].values())
    assert provenance["preferred"] == preferred(provenance["speed"])
    assert MODELS[default_model(where)][0] == provenance["preferred"]


def test_the_speed_check_runs_both_variants_as_the_engine_does() -> None:
    """measure() runs each built variant on the calibration texts and one query at a time."""
    speed = measure(default_model_dir())
    assert set(speed) == set(VARIANTS)
    assert all(s["texts_per_s"] > 1 and 0 < s["query_ms"] < 1_000 for s in speed.values())
