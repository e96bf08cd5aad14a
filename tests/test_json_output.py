"""The files approx writes are strict JSON: an undefined number (NaN, an infinity) is written as null, not as the
bare ``NaN`` that Python's json writes and other readers (JavaScript, jq, most JSON libraries) refuse."""

import json
import math

import pytest
from conftest import tiny_model

import approx
from approx import _json
from approx.harness import cli
from approx.integration import set_tuning, tuning


def strict(text: str):
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_dumps_writes_non_finite_numbers_as_null():
    obj = {"pearson": math.nan, "spread": [1.5, math.inf], "pair": (2, -math.inf), "ok": 0.25, "n": 3, "s": "NaN"}
    assert strict(_json.dumps(obj)) == {"pearson": None, "spread": [1.5, None], "pair": [2, None], "ok": 0.25, "n": 3,
                                        "s": "NaN"}  # fmt: skip
    with pytest.raises(ValueError, match="not strict"):
        strict(json.dumps({"pearson": math.nan}))  # what json alone writes


def test_eval_output_with_an_undefined_metric_is_strict_json(tmp_path):
    """`approx eval --output` (cli._write_results): a result whose Pearson correlation is undefined."""
    result = {"task": "stsb", "metrics": {"pearson": math.nan, "spearman": math.nan}, "fidelity": {"cosine": 0.99}}
    path = tmp_path / "out" / "result.json"
    cli._write_results([result], str(path))
    assert strict(path.read_text())["metrics"] == {"pearson": None, "spearman": None}


def test_saved_folder_with_a_non_finite_record_is_strict_json_and_loads(tmp_path):
    model = tiny_model("bert", num_hidden_layers=2)
    approx.patch(model, "window", window=4, block=8)
    set_tuning(model, {"target": "kl<=0.1", "fidelity": math.inf})
    approx.save(model, tmp_path / "saved")
    config = strict((tmp_path / "saved" / "approx_config.json").read_text())
    assert config["tuning"]["fidelity"] is None
    assert tuning(approx.load(tmp_path / "saved"))["fidelity"] is None
