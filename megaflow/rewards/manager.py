"""Turn rollouts into ``token_level_scores`` with the rule rewards of :mod:`.registry`."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from megaflow.protocol import DataProto
from megaflow.rewards.registry import RewardSpec, RewardTable, get_reward_spec

#: Prefix of the per-sample fields the manager returns (``reward_score``, ``reward_acc``...).
REWARD_FIELD_PREFIX = "reward_"


class RewardFunctionError(RuntimeError):
    """A scorer raised or returned an invalid value; names data source, sample and response.

    The original exception, if any, is chained as ``__cause__``.
    """


def score_one(fn: Callable[..., Any], source: str, text: str, truth: Any, extra: Any,
              kwargs: Mapping[str, Any], *, where: Callable[[], str] | str) -> dict[str, float]:
    """``fn(text, truth, extra, **kwargs)`` as a dict of floats with a finite ``"score"``.

    ``where`` describes the sample for an error (a string, or a function called only then).

    Raises:
        RewardFunctionError: the scorer raised, returned a dict without ``"score"``, a
            non-numeric value (a string) or a non-finite score (NaN, inf).
    """
    def fail(problem: str) -> RewardFunctionError:
        described = where() if callable(where) else where
        return RewardFunctionError(f"reward function for data source {source!r} {problem} ({described})")

    try:
        result = fn(text, truth, extra, **kwargs)
    except Exception as exc:
        raise fail(f"raised {type(exc).__name__}: {exc}") from exc
    out = dict(result) if isinstance(result, Mapping) else {"score": result}
    if "score" not in out:
        raise fail(f"returned a dict without 'score' (keys {sorted(out)})")
    try:
        out = {k: float(v) for k, v in out.items()}
    except (TypeError, ValueError):
        raise fail(f"returned non-numeric values {out!r}") from None
    if not math.isfinite(out["score"]):
        raise fail(f"returned a non-finite score {out['score']}")
    return out


class RuleRewardManager:
    """Score each response with the rule reward of its data source.

    For every row ``i``: decode ``responses[i]`` at the positions where
    ``response_mask[i] == 1`` (so padding, tokens after the first EOS and
    tool/observation tokens are not part of the text; correct when pad == eos), call the
    scorer registered for ``data_source[i]`` with ``ground_truth[i]`` and
    ``extra_info[i]``, and put the score on the last position where
    ``response_mask[i] == 1``.

    Empty responses (``response_mask[i].sum() == 0``, e.g. rows added for padding) are
    still scored on the empty string (so the per-sample fields are complete), but their
    ``token_level_scores`` row stays all zero: there is no token to carry the score.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
        reward_kwargs: ``{data_source: {kwarg: value}}`` passed to that source's scorer,
            e.g. ``{"openai/gsm8k": {"method": "flexible"}}``.
        max_error_chars: how much of the response an error message shows.
        table: the run's :class:`~megaflow.rewards.registry.RewardTable`; None: the
            process registry at the time of each call.

    Input fields: ``responses`` ``[batch, response_len]``, ``response_mask``
    ``[batch, response_len]``; non-tensor ``data_source`` and ``ground_truth`` (or verl's
    ``reward_model`` dicts), optional ``extra_info`` and ``index``.

    Output: a :class:`DataProto` with ``token_level_scores`` ``[batch, response_len]``
    (float32) and per-sample non-tensor fields ``reward_score`` and ``reward_<key>`` for
    every extra key a scorer returned (NaN for samples whose scorer did not return it).
    """

    def __init__(self, tokenizer: Any, *, reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                 max_error_chars: int = 200, table: RewardTable | None = None):
        self.tokenizer = tokenizer
        self.table = table
        self.reward_kwargs = {k: dict(v) for k, v in (reward_kwargs or {}).items()}
        self.max_error_chars = max_error_chars

    def __call__(self, data: DataProto) -> DataProto:
        responses, response_mask = self._tensors(data)
        sources, truths, extras = self._non_tensors(data)
        specs = self._specs(sources)
        num_rows, response_len = responses.shape
        scores = torch.zeros(num_rows, response_len, dtype=torch.float32)
        per_sample: dict[str, list[float]] = {}
        valid = response_mask.bool()
        for i in range(num_rows):
            spec = specs[sources[i]]
            text = self.tokenizer.decode(responses[i][valid[i]].tolist(),
                                         skip_special_tokens=spec.skip_special_tokens)
            result = self._score_one(spec, data, i, sources[i], text, truths[i], extras[i])
            for key, value in result.items():
                per_sample.setdefault(key, [math.nan] * num_rows)[i] = value
            positions = valid[i].nonzero()
            if len(positions):
                scores[i, positions[-1, 0]] = result["score"]
        non_tensors = {REWARD_FIELD_PREFIX + k: np.array(v, dtype=object) for k, v in per_sample.items()}
        return DataProto.from_dict({"token_level_scores": scores}, non_tensors=non_tensors)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _tensors(data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        keys = list(data.batch.keys()) if data.batch is not None else []
        missing = [k for k in ("responses", "response_mask") if k not in keys]
        if missing:
            raise ValueError(f"RuleRewardManager needs tensor fields {missing}; the batch has {keys}")
        assert data.batch is not None  # (no batch: both fields are missing above)
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        if responses.dim() != 2 or responses.shape != mask.shape:
            raise ValueError(
                f"responses {list(responses.shape)} and response_mask {list(mask.shape)} must both be "
                "[batch, response_len]"
            )
        return responses.cpu(), mask.cpu()

    @staticmethod
    def _non_tensors(data: DataProto) -> tuple[np.ndarray, list[Any], list[Any]]:
        nt = data.non_tensor_batch
        if "data_source" not in nt:
            raise ValueError(f"RuleRewardManager needs non-tensor field 'data_source'; the batch has {sorted(nt)}")
        if "ground_truth" in nt:
            truths = list(nt["ground_truth"])
        elif "reward_model" in nt:
            truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in nt["reward_model"]]
        else:
            raise ValueError(
                "RuleRewardManager needs non-tensor field 'ground_truth' (or verl's 'reward_model'); "
                f"the batch has {sorted(nt)}"
            )
        extras = list(nt["extra_info"]) if "extra_info" in nt else [None] * len(data)
        return nt["data_source"], truths, extras

    def _specs(self, sources: np.ndarray) -> dict[str, RewardSpec]:
        lookup = get_reward_spec if self.table is None else self.table.spec
        specs = {}
        for i, source in enumerate(sources):
            if source not in specs:
                try:
                    specs[source] = lookup(source)
                except ValueError as exc:
                    raise ValueError(f"sample {i}: {exc}") from None
        return specs

    def _score_one(self, spec: RewardSpec, data: DataProto, i: int, source: str, text: str,
                   truth: Any, extra: Any) -> dict[str, float]:
        return score_one(spec.fn, source, text, truth, extra, self.reward_kwargs.get(source, {}),
                         where=lambda: self._describe(data, i, text))

    def _describe(self, data: DataProto, i: int, text: str) -> str:
        parts = [f"sample {i}"]
        for key in ("index", "uid"):
            if key in data.non_tensor_batch:
                parts.append(f"{key}={data.non_tensor_batch[key][i]!r}")
        shown = text if len(text) <= self.max_error_chars else text[: self.max_error_chars] + "...[truncated]"
        parts.append(f"response={shown!r}")
        return ", ".join(parts)


def reward_metrics(scored: DataProto, data_sources: np.ndarray | None = None, *,
                   prefix: str = "reward", field_prefix: str = REWARD_FIELD_PREFIX) -> dict[str, float]:
    """Means of the manager's per-sample fields, overall and per data source.

    ``{f"{prefix}/{key}/mean": ..., f"{prefix}/{key}/{data_source}": ...}`` for every
    ``reward_<key>`` field of ``scored`` (NaN entries ignored; all-NaN keys omitted).
    ``data_sources`` defaults to ``scored``'s own ``data_source`` field when present;
    ``field_prefix``: the per-sample fields read (``cost_`` for the rule cost's).
    """
    nt = scored.non_tensor_batch
    if data_sources is None:
        data_sources = nt.get("data_source")
    metrics = {}
    for field, values in nt.items():
        if not field.startswith(field_prefix):
            continue
        key = field[len(field_prefix):]
        vals = np.asarray(values, dtype=np.float64)
        if np.isnan(vals).all():
            continue
        metrics[f"{prefix}/{key}/mean"] = float(np.nanmean(vals))
        if data_sources is not None:
            src = np.asarray(data_sources, dtype=object)
            for s in np.unique(src):
                sel = vals[src == s]
                if not np.isnan(sel).all():
                    metrics[f"{prefix}/{key}/{s}"] = float(np.nanmean(sel))
    return metrics
