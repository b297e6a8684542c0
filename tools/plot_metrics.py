#!/usr/bin/env python
"""Draw the metric curves of a run's ``metrics.jsonl`` to a PNG.

    python tools/plot_metrics.py --run outputs/tiny_arith_grpo
    python tools/plot_metrics.py --run RUN_DIR --out curves.png --keys 'critic/score/*' 'val/*'

``--run`` is a run directory holding ``metrics.jsonl`` (or the file itself). ``--keys``
takes metric names or shell-style patterns (default: every numeric metric except
``timing_s/*``, at most ``--max-plots``). One subplot per metric, x = step. Needs
matplotlib (headless ``Agg`` backend).
"""
from __future__ import annotations

import argparse
import fnmatch
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megaflow.utils.tracking import METRICS_FILE, read_metrics_jsonl

DEFAULT_EXCLUDE = ("timing_s/*",)
TITLE_FONTSIZE = 9
#: Drawn first when present (in this order); the other metrics follow alphabetically.
#: Safe RLHF runs add lambda, the mean episode cost and the cost critic's values and loss.
PRIORITY = ("critic/score/mean", "reward/acc/mean", "safe/lambda", "safe/episode_cost/mean", "safe/cost_values/mean",
            "cost_critic/vf_loss", "val/*", "response_length/mean", "actor/entropy")


def _priority(key: str) -> tuple[int, str]:
    ranks = [i for i, p in enumerate(PRIORITY) if fnmatch.fnmatchcase(key, p)]
    return (ranks[0] if ranks else len(PRIORITY), key)


def select_keys(records: Sequence[dict[str, Any]], patterns: Sequence[str] | None,
                max_plots: int) -> list[str]:
    """Metric names to draw: those matching ``patterns`` (in pattern order), or by default
    every numeric metric except ``timing_s/*``, the main ones (:data:`PRIORITY`) first.

    Raises:
        ValueError: a pattern matches no numeric metric (the available ones are listed).
    """
    available = sorted({k for r in records for k, v in r.items()
                        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    if not patterns:
        defaults = [k for k in available if not any(fnmatch.fnmatchcase(k, p) for p in DEFAULT_EXCLUDE)]
        return sorted(defaults, key=_priority)[:max_plots]
    keys: list[str] = []
    for pattern in patterns:
        matched = [k for k in available if fnmatch.fnmatchcase(k, pattern)]
        if not matched:
            raise ValueError(f"no metric matches {pattern!r}; available: {', '.join(available)}")
        keys.extend(k for k in matched if k not in keys)
    return keys[:max_plots]


def wrap_title(key: str, fits) -> str:
    """``key`` broken into lines that each satisfy ``fits(line)`` (a width test): after a
    ``/`` or ``_`` where possible, inside a name only when one part alone is too wide.
    Joining the lines gives ``key`` back."""
    parts = [p for p in re.split(r"(?<=[/_])", key) if p]
    lines: list[str] = []
    for part in parts:
        if lines and fits(lines[-1] + part):
            lines[-1] += part
            continue
        while len(part) > 1 and not fits(part):  # a part wider than the axes: cut it
            cut = next((i for i in range(len(part) - 1, 0, -1) if fits(part[:i])), 1)
            lines.append(part[:cut])
            part = part[cut:]
        lines.append(part)
    return "\n".join(lines)


def draw_metrics(records: Sequence[dict[str, Any]], keys: Sequence[str], *, title: str = "",
                 ncols: int = 3):
    """A figure with one subplot per key (value vs step; missing/null values skipped).

    The layout is matplotlib's constrained layout (room for every title, tick label and the
    figure title); a subplot title wider than its axes is wrapped at ``/`` and ``_`` so that
    titles of neighbouring subplots never overlap.

    Raises:
        ValueError: ``keys`` is empty.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not keys:
        raise ValueError("no metrics to plot")
    ncols = min(ncols, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False, layout="constrained")
    for ax, key in zip(axes.flat, keys, strict=False):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key, fontsize=TITLE_FONTSIZE)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    # Lay out once with the full titles' heights, then wrap each title to its axes' width
    # and lay out again (wrapping only adds lines above the axes, it does not widen them).
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]  # the Agg canvas has it; the base class stub does not
    for ax, key in zip(axes.flat, keys, strict=False):
        width = ax.get_window_extent(renderer).width
        prop = ax.title.get_fontproperties()

        def fits(text: str, width: float = width, prop=prop) -> bool:
            return renderer.get_text_width_height_descent(text, prop, ismath=False)[0] <= width

        ax.set_title(wrap_title(key, fits), fontsize=TITLE_FONTSIZE)
    fig.canvas.draw()
    return fig


def plot_metrics(records: Sequence[dict[str, Any]], keys: Sequence[str], out: Path, *,
                 title: str = "", ncols: int = 3) -> Path:
    """Write :func:`draw_metrics`' figure of ``keys`` to the PNG ``out``; returns ``out``."""
    fig = draw_metrics(records, keys, title=title, ncols=ncols)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="plot a run's metrics.jsonl to PNG")
    parser.add_argument("--run", required=True, help=f"run directory with {METRICS_FILE}, or the file")
    parser.add_argument("--out", help="output PNG (default: <run>/metrics.png)")
    parser.add_argument("--keys", nargs="+", help="metric names or glob patterns")
    parser.add_argument("--max-plots", type=int, default=24)
    args = parser.parse_args(argv)
    run = Path(args.run)
    path = run if run.is_file() else run / METRICS_FILE
    try:
        if not path.is_file():
            raise FileNotFoundError(f"no metrics file at {path}")
        records = read_metrics_jsonl(path)
        if not records:
            raise ValueError(f"{path} holds no metrics records")
        keys = select_keys(records, args.keys, args.max_plots)
        out = Path(args.out) if args.out else path.parent / "metrics.png"
        plot_metrics(records, keys, out, title=str(path.parent))
    except ImportError as exc:
        print(f"plot_metrics: error: matplotlib is required ({exc})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"plot_metrics: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({len(keys)} metrics, {len(records)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
