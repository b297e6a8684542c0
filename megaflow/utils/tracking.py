"""Metrics tracking: console, JSONL, TensorBoard and (optionally) wandb, plus a progress bar.

``Tracking(...).log(metrics, step)`` sends one step's metrics to every configured backend:

* ``console``: a short line of key figures (:data:`KEY_FIGURES`) every
  ``console_every`` steps, printed through the progress bar so the bar stays at the
  bottom;
* ``jsonl``: ``<log_dir>/metrics.jsonl``, one JSON object ``{"step": s, ...}`` per step,
  flushed after every step; opened in append mode, so a resumed run continues the same
  file (readers merge the records of a step, see :func:`read_metrics_jsonl`);
* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` in ``<log_dir>/tensorboard``,
  one scalar per numeric metric, flushed every step;
* ``wandb``: imported lazily; requesting it without the package installed is an error.

A ``tqdm`` bar over ``total_steps`` shows the same key figures.
"""
from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
#: The package each backend imports when it starts (backends not listed need none).
BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
METRICS_FILE = "metrics.jsonl"
#: Sample generations (:meth:`Tracking.log_generations`), one JSON object per sample.
GENERATIONS_FILE = "generations.jsonl"


def _scalar(value: Any) -> float | None:
    """A Python float for real numbers, bools, numpy scalars and one-element tensors/arrays."""
    if isinstance(value, (bool, numbers.Real)):
        return float(value)
    numel = getattr(value, "numel", None)  # torch.Tensor
    if callable(numel) and numel() == 1:
        return float(value.item())
    size = getattr(value, "size", None)  # numpy.ndarray
    if isinstance(size, int) and size == 1 and hasattr(value, "item"):
        return float(value.item())
    return None


#: The figures a user watches, ``(label, metric keys by preference)``: shown on the progress
#: bar and in the console's short step line. KL is the KL loss term when the actor has one,
#: else the KL penalty in the reward, else the policy's change over the update (approx_kl).
KEY_FIGURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("critic/score/mean",)),
    ("resp_len", ("response_length/mean",)),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/approx_kl")),
    ("grad_norm", ("actor/grad_norm",)),
    ("step_s", ("timing_s/step",)),
    ("val", ("val/score/mean",)),
    ("eta", ("timing_s/eta",)),
)
#: The bar's layout: tqdm's default without its own remaining time (from the step rate, which
#: misses validation); the ``eta`` figure (``timing_s/eta``, RayPPOTrainer.fit) counts validation.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


def key_figures(metrics: Mapping[str, float]) -> dict[str, float]:
    """``{label: value}`` of :data:`KEY_FIGURES` present in ``metrics``, in that order."""
    out = {}
    for label, keys in KEY_FIGURES:
        for key in keys:
            if key in metrics:
                out[label] = metrics[key]
                break
    return out


class _Backend(Protocol):
    """What :class:`Tracking` calls on each backend."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _ConsoleBackend:
    """A short line of :func:`key_figures` every ``every`` steps and at ``last_step``
    (``every`` 0: none); the full set goes to the other backends."""

    def __init__(self, write, every: int = 1, last_step: int | None = None):
        self.write, self.every, self.last_step = write, every, last_step

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.every or (step % self.every and step != self.last_step):
            return
        figures = key_figures(metrics)
        if figures:
            total = f"/{self.last_step}" if self.last_step is not None else ""
            self.write(f"[step {step}{total}] " + "  ".join(f"{k}={_fmt_figure(k, v)}" for k, v in figures.items()))

    def log_generations(self, records: Sequence[Mapping[str, Any]], step: int, split: str) -> None:
        # one write: the bar is redrawn once, below the whole block
        self.write("\n".join([f"[step {step}] {split} samples:"] + [_generation_lines(r) for r in records]))

    def close(self) -> None:
        pass


class _JsonlBackend:
    def __init__(self, log_dir: Path):
        self.path = log_dir / METRICS_FILE
        self.file = self.path.open("a", encoding="utf-8")
        self.generations_path = log_dir / GENERATIONS_FILE

    def log_generations(self, records: Sequence[Mapping[str, Any]], step: int, split: str) -> None:
        with self.generations_path.open("a", encoding="utf-8") as file:
            for record in records:
                file.write(json.dumps({"step": step, "split": split, **record}) + "\n")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record: dict[str, float | None] = {"step": step}
        record.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _TensorBoardBackend:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_generations(self, records: Sequence[Mapping[str, Any]], step: int, split: str) -> None:
        """One Markdown text per split and step: each sample's reward parts, prompt and response."""
        blocks = []
        for record in records:
            parts = ", ".join(f"{k}={v:.4g}" for k, v in record["reward"].items())
            blocks.append(f"**{parts}** ({record['response_tokens']} tokens)\n\n"
                          f"prompt:\n\n    {_indent(record['prompt'])}\n\n"
                          f"response:\n\n    {_indent(record['response'])}")
        self.writer.add_text(f"generations/{split}", "\n\n---\n\n".join(blocks), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbBackend:
    def __init__(self, project: str, experiment: str, config: Mapping[str, Any] | None, log_dir: Path):
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "the 'wandb' logger backend was requested but the wandb package is not installed; "
                "install it (pip install 'megaflow[wandb]') or remove 'wandb' from the logger backends"
            ) from exc
        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=dict(config or {}),
                              dir=str(log_dir), resume="allow")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class Tracking:
    """Send per-step metrics to several backends and drive a progress bar.

    Args:
        project: project name (the wandb project).
        experiment: run name (the wandb run name and the bar's label).
        backends: subset of :data:`BACKENDS` (a single name is accepted too).
        log_dir: directory for ``metrics.jsonl`` and ``tensorboard/`` (created).
        config: the run's resolved config (a dict), recorded by wandb.
        total_steps: length of the progress bar; None disables the bar.
        initial_step: where the bar starts (the resumed step).
        console_every: the console backend's short line every N steps (and at
            ``total_steps``); 0: only the bar.

    The bar and the console line show :func:`key_figures` (reward, response length, KL,
    grad norm, step time, validation score), not every metric.

    Metric values that are not numeric scalars are dropped (logged at debug level);
    NaN/inf are written to JSONL as ``null``.

    Raises:
        ValueError: unknown backend names (the valid ones are listed).
        ImportError: ``wandb`` requested but not installed.
    """

    def __init__(self, project: str, experiment: str, backends: Sequence[str] = ("console", "jsonl"), *,
                 log_dir: str | Path = "outputs/run", config: Mapping[str, Any] | None = None,
                 total_steps: int | None = None, initial_step: int = 0, console_every: int = 1):
        backends = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown logger backend(s) {unknown}; valid backends: {', '.join(BACKENDS)}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.bar = None
        if total_steps is not None:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc=experiment, unit="step",
                            dynamic_ncols=True, bar_format=BAR_FORMAT)
        self._last_step = initial_step
        factories: dict[str, Callable[[], _Backend]] = {
            "console": lambda: _ConsoleBackend(self.write, console_every, total_steps),
            "jsonl": lambda: _JsonlBackend(self.log_dir),
            "tensorboard": lambda: _TensorBoardBackend(self.log_dir),
            "wandb": lambda: _WandbBackend(project, experiment, config, self.log_dir),
        }
        self.backends: dict[str, _Backend] = {}
        try:
            for name in dict.fromkeys(backends):
                self.backends[name] = factories[name]()
        except BaseException:
            self.close()
            raise

    def write(self, line: str) -> None:
        """Print ``line`` on the console on its own line, above the progress bar when there is one."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def progress(self, total: int, desc: str) -> Any:
        """A bar for a long phase inside a step (validation: ``total`` prompts), below the
        step bar and removed when closed (use it as a context manager); silent when the
        run has no step bar."""
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="prompt", leave=False, dynamic_ncols=True,
                    position=1, disable=self.bar is None)

    def log_generations(self, records: Sequence[Mapping[str, Any]], step: int, split: str) -> None:
        """Log sample generations (``[{"prompt", "response", "response_tokens", "reward": {part:
        value}, ...}]``, :func:`megaflow.trainer.generations.sample_generations`) of ``split``
        (``train`` / ``val``) at ``step``: a short form on the console, every field to
        ``generations.jsonl`` (with the jsonl backend) and a text entry in TensorBoard."""
        if not records:
            return
        for backend in self.backends.values():
            log = getattr(backend, "log_generations", None)
            if log is not None:
                log(records, step, split)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step. Values that are not numeric scalars are dropped."""
        scalars = {}
        for key, value in metrics.items():
            number = _scalar(value)
            if number is None:
                logger.debug("dropping non-numeric metric %r=%r", key, value)
            else:
                scalars[str(key)] = number
        for backend in self.backends.values():
            backend.log(scalars, step)
        self._advance_bar(scalars, step)

    def _advance_bar(self, scalars: Mapping[str, float], step: int) -> None:
        if self.bar is None:
            return
        if step > self._last_step:
            self.bar.update(step - self._last_step)
            self._last_step = step
        postfix = {k: _fmt_figure(k, v) for k, v in key_figures(scalars).items()}
        if postfix:
            self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        """Flush and close every backend and the bar (idempotent)."""
        for backend in self.backends.values():
            backend.close()
        self.backends = {}
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: Library warnings every worker process repeats at start-up or every step, each with why
#: it is safe to hide on this stack. They are ``(message prefix, category)`` for the
#: ``warnings`` filters of every process (:func:`warning_filters_env`).
KNOWN_LIBRARY_WARNINGS: tuple[tuple[str, str], ...] = (
    # megatron-core without Transformer Engine / Apex (always so on CPU; optional on GPU)
    # falls back to its local kernels, which is what megaflow's CPU path uses on purpose.
    ("Transformer Engine and Apex are not installed", "UserWarning"),
    ("Apex is not installed", "UserWarning"),
    # A throughput hint for CUDA streams; meaningless on CPU and set by launchers on GPU.
    ("When using async grad allreduce it is recommended", "UserWarning"),
    # megatron-core's optimizer probes `.grad` of every parameter with hasattr(); the
    # parameters are leaves, the probe only trips torch's generic non-leaf warning.
    ("The .grad attribute of a Tensor that is not a leaf Tensor", "UserWarning"),
    # TransformerConfig's own default (cuda_graph_scope) triggers its deprecation notice;
    # megaflow does not capture CUDA graphs.
    ("full scope is deprecated", "UserWarning"),
)


def warning_filters_env(existing: str | None = None) -> str:
    """A ``PYTHONWARNINGS`` value that ignores :data:`KNOWN_LIBRARY_WARNINGS`, after
    ``existing`` (the user's own filters keep working)."""
    filters = [f"ignore:{message}:{category}" for message, category in KNOWN_LIBRARY_WARNINGS]
    return ",".join(([existing] if existing else []) + filters)


def filter_known_warnings() -> None:
    """Install :data:`KNOWN_LIBRARY_WARNINGS` as ignore filters in this process."""
    import builtins
    import re
    import warnings

    for message, category in KNOWN_LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category))


def read_metrics_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``, one per step in step order.

    Records of the same step are merged, later values winning key by key: a step
    logged in several calls keeps all its metrics, and a run resumed from an earlier
    checkpoint (which logs the steps after it again) replaces the stale values. A
    truncated last line (a crash mid-write) is skipped with a warning; a malformed line
    elsewhere raises ValueError naming the line.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if lineno == len(lines):
                logger.warning("%s: skipping truncated last line %d", path, lineno)
                continue
            raise ValueError(f"{path}, line {lineno}: not a metrics record ({exc})") from exc
        by_step.setdefault(step, {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def _indent(text: str) -> str:
    """``text`` as a Markdown code block's body (every line indented)."""
    return text.replace("\n", "\n    ")


def _generation_lines(record: Mapping[str, Any], width: int = 100) -> str:
    """A sample on the console: its reward parts, the prompt's end and the response's start,
    whitespace folded, each cut to ``width`` characters."""
    def clip(text: str, keep_end: bool) -> str:
        text = " ".join(text.split())
        if len(text) <= width:
            return text
        return "..." + text[-width:] if keep_end else text[:width] + "..."

    parts = " ".join(f"{k}={v:.3g}" for k, v in record["reward"].items())
    return (f"  [{parts}] ({record['response_tokens']} tokens)\n"
            f"    prompt: {clip(record['prompt'], keep_end=True)}\n"
            f"    response: {clip(record['response'], keep_end=False)}")


def _fmt_figure(label: str, value: float) -> str:
    """A key figure as shown: the ``eta`` as [h:]mm:ss, others by :func:`_fmt`."""
    if label == "eta":
        from tqdm import tqdm

        return tqdm.format_interval(max(0.0, value))
    return _fmt(value)


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if not float(value).is_integer() else str(int(value))
