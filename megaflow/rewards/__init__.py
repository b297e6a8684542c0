"""Rule-based rewards by data source and the manager that writes ``token_level_scores``.

* :mod:`.registry`: ``compute_score(data_source, solution_str, ground_truth, extra_info)``
  and :func:`register_reward`; :class:`RewardTable`, the scorers of one run.
* :mod:`.gsm8k`, :mod:`.arith`, :mod:`.countdown`: the built-in scorers;
  :mod:`.format`: format rewards.
* :mod:`.manager`: :class:`RuleRewardManager` (DataProto -> ``token_level_scores``).
"""
from megaflow.rewards.format import format_reward, with_format_reward
from megaflow.rewards.manager import RewardFunctionError, RuleRewardManager, reward_metrics
from megaflow.rewards.registry import (
    RewardSpec,
    RewardTable,
    compute_score,
    get_reward_spec,
    known_data_sources,
    register_reward,
    unregister_reward,
)

__all__ = [
    "format_reward", "with_format_reward", "RewardFunctionError", "RuleRewardManager", "reward_metrics",
    "RewardSpec", "RewardTable", "compute_score", "get_reward_spec", "known_data_sources", "register_reward",
    "unregister_reward",
]
