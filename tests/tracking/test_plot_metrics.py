"""tools/plot_metrics.py: key selection, errors, and the PNG when matplotlib is installed."""
import importlib.util
import sys
from pathlib import Path

import pytest

from megaflow.utils.tracking import Tracking, read_metrics_jsonl

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "tools" / "plot_metrics.py")
plot_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_metrics)


@pytest.fixture
def run_dir(tmp_path):
    with Tracking("p", "e", backends=["jsonl"], log_dir=tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log({"critic/score/mean": step / 10, "critic/score/max": 1.0, "actor/entropy": 2.0 - step / 10,
                         "timing_s/step": 0.5}, step=step)
        tracker.log({"val/score/mean": 0.4}, step=5)  # a second record of step 5 is merged
    return tmp_path


def test_select_keys(run_dir):
    records = read_metrics_jsonl(run_dir / "metrics.jsonl")
    assert records[-1]["val/score/mean"] == 0.4 and records[-1]["critic/score/mean"] == 0.5
    assert plot_metrics.select_keys(records, None, 24) == [  # main metrics first
        "critic/score/mean", "val/score/mean", "actor/entropy", "critic/score/max"]
    records = [{"step": 1, "a/x": 1.0, "a/y": 2, "b": 3.0, "timing_s/gen": 1.0, "s": "text"}]
    assert plot_metrics.select_keys(records, None, 24) == ["a/x", "a/y", "b"]
    assert plot_metrics.select_keys(records, None, 2) == ["a/x", "a/y"]
    assert plot_metrics.select_keys(records, ["b", "a/*"], 24) == ["b", "a/x", "a/y"]
    with pytest.raises(ValueError, match=r"no metric matches 'c/\*'; available: a/x, a/y, b, timing_s/gen"):
        plot_metrics.select_keys(records, ["c/*"], 24)


def test_cli_errors(tmp_path, capsys, monkeypatch):
    assert plot_metrics.main(["--run", str(tmp_path / "none")]) == 1
    assert "no metrics file at" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot_metrics.main(["--run", str(tmp_path)]) == 1
    assert "matplotlib is required" in capsys.readouterr().err


def test_png_written(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "curves.png"
    assert plot_metrics.main(["--run", str(run_dir), "--out", str(out), "--keys", "critic/score/*"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 metrics, 5 steps" in capsys.readouterr().out
