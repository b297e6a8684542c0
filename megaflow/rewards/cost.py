"""Rule costs for Safe RLHF (:mod:`megaflow.algorithms.safe_rlhf`): one cost per response.

A cost function has the reward scorers' signature (:mod:`megaflow.rewards.registry`)::

    fn(solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

and returns the cost as the float or the dict's ``"score"`` (its other keys are reported per
sample as ``cost/<key>/mean``). Unlike rewards, one cost function scores every data source.
Built-in costs (:data:`COST_FUNCTIONS`; their episode-cost ranges are
:data:`megaflow.config.schema.COST_FUNCTION_RANGES`, checked against
``algorithm.safe_rlhf.cost_limit`` at load):

=================  =====================================================  ========
name               cost                                                   range
=================  =====================================================  ========
``contains_digit`` 1 if the response's text (up to its first EOS) contains  [0, 1]
                   the character of ``digit``, else 0
=================  =====================================================  ========
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from megaflow.protocol import DataProto
from megaflow.rewards.manager import REWARD_FIELD_PREFIX, RuleRewardManager, score_one
from megaflow.rewards.registry import RewardSpec

#: Prefix of the per-sample fields of :class:`RuleCostManager` (``cost_score``, ...).
COST_FIELD_PREFIX = "cost_"


def contains_digit(solution_str: str, ground_truth: Any = None, extra_info: dict | None = None, *,
                   digit: int, eos_token: str = "<eos>") -> dict[str, float]:
    """Cost 1 if the response's text before its first ``eos_token`` contains ``str(digit)``, else 0.

    Returns ``{"score": cost}``.

    Raises:
        ValueError: ``digit`` is not an integer in 0-9.
    """
    if isinstance(digit, bool) or not isinstance(digit, int) or not 0 <= digit <= 9:
        raise ValueError(f"contains_digit: digit must be an integer in 0-9, got {digit!r}")
    head = solution_str.partition(eos_token)[0]
    return {"score": float(str(digit) in head)}


#: Built-in cost functions by name (``algorithm.safe_rlhf.cost_function``).
COST_FUNCTIONS: dict[str, Callable[..., Any]] = {"contains_digit": contains_digit}


class RuleCostManager(RuleRewardManager):
    """Score every response with one cost function: ``token_level_costs`` ``[B, R]`` (the cost
    on the last valid response token, like :class:`~megaflow.rewards.manager.RuleRewardManager`'s
    scores) and per-sample ``cost_<key>`` fields.

    Args:
        tokenizer: decodes the responses (special tokens kept, so an EOS marks the end).
        fn: the cost function (see the module docstring).
        cost_kwargs: keyword arguments of ``fn``.

    Input fields: as :class:`~megaflow.rewards.manager.RuleRewardManager` (``data_source``
    names the sample in an error; ``ground_truth`` is passed on).

    Raises (on call):
        RewardFunctionError: the cost function raised or returned a non-finite cost.
    """

    def __init__(self, tokenizer: Any, fn: Callable[..., Any], cost_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(tokenizer)
        self.spec = RewardSpec(fn, skip_special_tokens=False)
        self.cost_kwargs = dict(cost_kwargs or {})

    def _specs(self, sources: np.ndarray) -> dict[str, RewardSpec]:
        return dict.fromkeys(set(sources), self.spec)

    def _score_one(self, spec: RewardSpec, data: DataProto, i: int, source: str, text: str,
                   truth: Any, extra: Any) -> dict[str, float]:
        return score_one(spec.fn, source, text, truth, extra, self.cost_kwargs,
                         where=lambda: self._describe(data, i, text))

    def __call__(self, data: DataProto) -> DataProto:
        scored = super().__call__(data)
        assert scored.batch is not None  # (the manager always returns token_level_scores)
        fields = {COST_FIELD_PREFIX + k[len(REWARD_FIELD_PREFIX):]: v for k, v in scored.non_tensor_batch.items()}
        return DataProto.from_dict({"token_level_costs": scored.batch["token_level_scores"]}, non_tensors=fields)


__all__ = ["contains_digit", "COST_FUNCTIONS", "RuleCostManager", "COST_FIELD_PREFIX"]
