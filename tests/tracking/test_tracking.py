"""Tracking backends (JSONL, TensorBoard, console, wandb)."""
import json
import sys
import types

import numpy as np
import pytest
import torch

from megaflow.utils.tracking import Tracking, key_figures, read_metrics_jsonl


def test_jsonl_one_object_per_step_flushed_and_appended(tmp_path):
    tracker = Tracking("p", "e", backends=["jsonl"], log_dir=tmp_path)
    tracker.log({"critic/score/mean": 0.5, "n": np.int64(3), "t": torch.tensor(2.5), "note": "skipped"}, step=1)
    # flushed before close: another reader sees the step already
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"step": 1, "critic/score/mean": 0.5, "n": 3.0, "t": 2.5}]
    tracker.log({"critic/score/mean": float("nan")}, step=2)
    tracker.close()
    # a resumed run appends to the same file
    with Tracking("p", "e", backends=["jsonl"], log_dir=tmp_path) as resumed:
        resumed.log({"critic/score/mean": 0.7}, step=2)
        resumed.log({"critic/score/mean": 0.9}, step=3)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[1]) == {"step": 2, "critic/score/mean": None}
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")  # later values of a step win
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 0.5), (2, 0.7), (3, 0.9)]


def test_read_metrics_skips_a_truncated_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1, "a": 1}\nnot json\n{"step": 3, "a": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a metrics record"):
        read_metrics_jsonl(path)


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking("p", "e", backends=["tensorboard"], log_dir=tmp_path) as tracker:
        for step in range(1, 4):
            tracker.log({"critic/score/mean": 0.1 * step, "timing_s/step": float(step)}, step=step)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"critic/score/mean", "timing_s/step"}
    events = acc.Scalars("critic/score/mean")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([0.1, 0.2, 0.3])


def test_console_lines_and_progress_bar(tmp_path, capsys):
    with Tracking("p", "run", backends=["console", "jsonl"], log_dir=tmp_path, total_steps=4) as tracker:
        tracker.log({"critic/score/mean": 0.25, "timing_s/step": 1.5, "lr": 1e-6}, step=1)
        tracker.log({"critic/score/mean": 0.5, "timing_s/step": 1.25, "actor/grad_norm": 2.0,
                     "response_length/mean": 3.5, "actor/approx_kl": 0.0, "actor/entropy": 2.7}, step=2)
        bar = tracker.bar
        assert bar.n == 2 and bar.total == 4
        assert bar.postfix == "reward=0.5, resp_len=3.5, kl=0, grad_norm=2, step_s=1.25"
    captured = capsys.readouterr()
    assert "[step 1/4] reward=0.25  step_s=1.5\n" in captured.out  # key figures only: no lr
    assert "[step 2/4] reward=0.5  resp_len=3.5  kl=0  grad_norm=2  step_s=1.25\n" in captured.out
    assert "entropy" not in captured.out and read_metrics_jsonl(tmp_path / "metrics.jsonl")[1]["actor/entropy"] == 2.7


def test_resumed_bar_counts_only_this_runs_steps(tmp_path):
    # A run resumed at step 10 of 12: the bar starts at 10/12 and its rate covers the 2 steps
    # this run trains, not the 10 restored ones as if they had taken no time.
    with Tracking("p", "run", backends=[], log_dir=tmp_path, total_steps=12, initial_step=10) as tracker:
        bar = tracker.bar
        assert (bar.n, bar.total) == (10, 12)
        bar.start_t -= 4.0  # 4 s since the bar started
        tracker.log({"critic/score/mean": 0.5}, step=11)
        assert bar.n == 11
        shown = bar.format_meter(**bar.format_dict)
        # 1 step in 4 s: 4 s a step (started at 0: 11 steps in 4 s, 2.75 step/s); no tqdm remaining
        # time (the trainer's eta figure counts validation too)
        assert "11/12 [00:04, " in shown and "<" not in shown and "s/step" in shown
        assert float(shown.split("s/step")[0].rsplit(" ", 1)[1]) == pytest.approx(4.0, rel=0.05)


def test_console_line_every_n_steps_and_after_the_last(tmp_path, capsys):
    with Tracking("p", "run", backends=["console"], log_dir=tmp_path, total_steps=7, console_every=3) as tracker:
        for step in range(1, 8):
            tracker.log({"critic/score/mean": step / 10}, step=step)
    steps = [line.split("]")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("[step")]
    assert steps == ["[step 3/7", "[step 6/7", "[step 7/7"]
    with Tracking("p", "run", backends=["console"], log_dir=tmp_path, total_steps=3, console_every=0) as tracker:
        for step in range(1, 4):
            tracker.log({"critic/score/mean": 0.5}, step=step)
    assert "[step" not in capsys.readouterr().out


def test_kl_figure_prefers_the_kl_loss():
    assert key_figures({"actor/approx_kl": 0.1, "actor/kl_loss": 0.2}) == {"kl": 0.2}
    assert key_figures({"actor/approx_kl": 0.1, "actor/reward_kl_penalty": 0.3}) == {"kl": 0.3}


def test_unknown_backend_and_missing_wandb(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown logger backend\(s\) \['mlflow'\]; valid backends: console"):
        Tracking("p", "e", backends=["jsonl", "mlflow"], log_dir=tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="'wandb' logger backend was requested but the wandb package is not"):
        Tracking("p", "e", backends=["jsonl", "wandb"], log_dir=tmp_path)


def test_wandb_backend_calls(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with Tracking("proj", "exp", backends=["wandb"], log_dir=tmp_path, config={"lr": 1e-6}) as tracker:
        tracker.log({"a": 1}, step=7)
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["name"] == "exp"
    assert calls[0][1]["config"] == {"lr": 1e-6}
    assert calls[1:] == [("log", {"a": 1.0}, 7), ("finish",)]
