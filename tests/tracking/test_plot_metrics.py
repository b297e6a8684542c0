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


def test_safe_rlhf_curves_come_right_after_the_score():
    records = [{"step": 1, "critic/score/mean": 0.1, "a/x": 1.0, "safe/lambda": 1.2, "safe/episode_cost/mean": 0.3,
                "safe/cost_values/mean": 0.2, "cost_critic/vf_loss": 0.05, "safe/log_lambda": 0.18}]
    assert plot_metrics.select_keys(records, None, 5) == [
        "critic/score/mean", "safe/lambda", "safe/episode_cost/mean", "safe/cost_values/mean", "cost_critic/vf_loss"]


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


LONG_KEYS = ["training/rollout_probs_diff_mean", "rollout_corr/token_mult_prob_error_before_rejection_sampling",
             "perf/throughput_tokens_per_s_per_rank_including_weight_sync",
             "x/" + "averyveryverylongmetricnamewithoutanyseparatorsthatisfartoowideforonesubplot", "a/b"]


def _title_overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of drawn texts (subplot titles, the figure title, other subplots' areas) whose
    boxes intersect, and ``(text, "figure edge")`` for a title cut off by the figure's edge."""
    renderer = fig.canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    boxes = [(f"title {ax.get_title()!r}", ax.title.get_window_extent(renderer), ax) for ax in axes]
    if fig._suptitle is not None:
        boxes.append(("suptitle", fig._suptitle.get_window_extent(renderer), None))
    areas = [(f"axes of {ax.get_title()!r}", ax.get_window_extent(renderer), ax) for ax in axes]
    hits = [(a, b) for i, (a, box_a, _) in enumerate(boxes) for b, box_b, _ in boxes[i + 1:] if box_a.overlaps(box_b)]
    hits += [(a, b) for a, box_a, own in boxes for b, box_b, ax in areas if ax is not own and box_a.overlaps(box_b)]
    edge = fig.bbox
    hits += [(a, "figure edge") for a, box, _ in boxes
             if box.x0 < edge.x0 or box.x1 > edge.x1 or box.y0 < edge.y0 or box.y1 > edge.y1]
    return hits


def test_long_titles_are_wrapped_and_do_not_overlap():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    records = [{"step": s, **{k: float(s) for k in LONG_KEYS}} for s in range(1, 4)]
    fig = plot_metrics.draw_metrics(records, LONG_KEYS, title="/a/run/directory/of/some/length")
    try:
        assert _title_overlaps(fig) == []
        titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
        assert [t.replace("\n", "") for t in titles] == LONG_KEYS  # every name is shown whole
        assert titles[-1] == "a/b" and titles[3].startswith("x/\n")  # breaks after '/' first
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes[:len(LONG_KEYS)]:
            assert ax.title.get_window_extent(renderer).width <= ax.get_window_extent(renderer).width
    finally:
        plt.close(fig)
    # The former layout (full titles, tight_layout, then a figure title) collides: the check
    # above can fail.
    fig, axes = plt.subplots(1, 3, figsize=(3 * 4.2, 3.0), squeeze=False)
    for ax, key in zip(axes.flat, LONG_KEYS[2:]):
        ax.set_title(key, fontsize=9)
    fig.suptitle("/a/run/directory/of/some/length", fontsize=10)
    fig.tight_layout()
    fig.canvas.draw()
    try:
        assert _title_overlaps(fig)
    finally:
        plt.close(fig)


def test_wrap_title_breaks_after_separators_then_inside_names():
    def fits(text):
        return len(text) <= 8

    assert plot_metrics.wrap_title("actor/lr", fits) == "actor/lr"
    assert plot_metrics.wrap_title("critic/score/mean", fits) == "critic/\nscore/\nmean"
    assert plot_metrics.wrap_title("a/abcdefghijkl_xy", fits) == "a/\nabcdefgh\nijkl_xy"
