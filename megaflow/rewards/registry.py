"""Rule rewards keyed by the dataset's ``data_source`` column.

A scorer has the signature of verl's ``default_compute_score``::

    fn(solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

and a dict result carries at least ``"score"``; its other keys (``acc``, ``format``...)
are reported per sample. Built-in data sources:

================================  ==========================================  ================
data_source                       scorer                                      special tokens
================================  ==========================================  ================
``openai/gsm8k``, ``gsm8k``       :func:`megaflow.rewards.gsm8k.compute_score`  skipped
``arith``                         :func:`megaflow.rewards.arith.compute_score`  kept (EOS counts)
``countdown``                     :func:`megaflow.rewards.countdown.compute_score`  skipped
``tool_arith``                    :func:`megaflow.rewards.tool_arith.compute_score`  kept (turn ends count)
================================  ==========================================  ================

"special tokens" says how :class:`~megaflow.rewards.manager.RuleRewardManager` decodes the
response for that source. Add sources for every later use in the process with
:func:`register_reward`. A training run never changes this registry: it scores with its
own :class:`RewardTable`, a snapshot of the registry plus the run's ``reward.functions``
and format reward, so two runs in one process do not see each other's scorers.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import megaflow.rewards.arith as arith
import megaflow.rewards.countdown as countdown
import megaflow.rewards.gsm8k as gsm8k
import megaflow.rewards.tool_arith as tool_arith

ScoreFn = Callable[..., "float | dict[str, Any]"]


@dataclass(frozen=True)
class RewardSpec:
    """A registered scorer and how its responses are decoded."""

    fn: ScoreFn
    skip_special_tokens: bool = True


_REGISTRY: dict[str, RewardSpec] = {
    "openai/gsm8k": RewardSpec(gsm8k.compute_score),
    "gsm8k": RewardSpec(gsm8k.compute_score),
    "arith": RewardSpec(arith.compute_score, skip_special_tokens=False),
    "countdown": RewardSpec(countdown.compute_score),
    "tool_arith": RewardSpec(tool_arith.compute_score, skip_special_tokens=False),
}


def register_reward(
    *data_sources: str, skip_special_tokens: bool = True, override: bool = False
) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator registering a scorer for one or more data sources.

    Example::

        @register_reward("my_task")
        def my_score(solution_str, ground_truth, extra_info=None): ...

    Raises:
        ValueError: no data source given, or one is already registered and
            ``override`` is False.
    """
    if not data_sources:
        raise ValueError("register_reward needs at least one data source name")

    def decorator(fn: ScoreFn) -> ScoreFn:
        taken = [s for s in data_sources if s in _REGISTRY and not override]
        if taken:
            raise ValueError(f"data source(s) {taken} already have a reward; pass override=True to replace")
        for source in data_sources:
            _REGISTRY[source] = RewardSpec(fn, skip_special_tokens=skip_special_tokens)
        return fn

    return decorator


def unregister_reward(data_source: str) -> None:
    """Remove a registered data source (KeyError if unknown)."""
    del _REGISTRY[data_source]


def known_data_sources() -> list[str]:
    """Sorted names of the registered data sources."""
    return sorted(_REGISTRY)


def get_reward_spec(data_source: str) -> RewardSpec:
    """The :class:`RewardSpec` of ``data_source``.

    Raises:
        ValueError: unknown data source; the message lists the known ones.
    """
    try:
        return _REGISTRY[data_source]
    except (KeyError, TypeError):
        raise _unknown(data_source, known_data_sources()) from None


def _unknown(data_source: Any, known: list[str]) -> ValueError:
    return ValueError(f"no rule reward registered for data_source {data_source!r}; known data sources: "
                      f"{', '.join(known)} (add one with megaflow.rewards.register_reward)")


@dataclass(frozen=True)
class RewardTable:
    """The scorers of one run: data source -> :class:`RewardSpec`, never changed in place.

    Build it with :meth:`registered` (a snapshot of the process registry) and derive the
    run's table with :meth:`with_functions` and :meth:`with_format_reward`; each returns a
    new table.
    """

    specs: Mapping[str, RewardSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", MappingProxyType(dict(self.specs)))

    @classmethod
    def registered(cls) -> RewardTable:
        """The registry as it is now (built-ins plus :func:`register_reward` additions)."""
        return cls(_REGISTRY)

    def with_functions(self, functions: Mapping[str, ScoreFn], skip_special_tokens: bool = True) -> RewardTable:
        """A table where each ``functions[source]`` scores ``source`` (replacing a built-in)."""
        return RewardTable({**self.specs, **{s: RewardSpec(fn, skip_special_tokens=skip_special_tokens)
                                             for s, fn in functions.items()}})

    def with_format_reward(self, pattern: str, format_weight: float) -> RewardTable:
        """A table whose every scorer is wrapped by
        :func:`megaflow.rewards.format.with_format_reward` (``(1 - w) * base + w * format``).

        Raises:
            ValueError: ``format_weight`` outside [0, 1].
        """
        from megaflow.rewards.format import with_format_reward

        return RewardTable({s: RewardSpec(with_format_reward(spec.fn, pattern, format_weight=format_weight),
                                          skip_special_tokens=spec.skip_special_tokens)
                            for s, spec in self.specs.items()})

    def sources(self) -> list[str]:
        """Sorted data-source names."""
        return sorted(self.specs)

    def spec(self, data_source: str) -> RewardSpec:
        """The :class:`RewardSpec` of ``data_source``.

        Raises:
            ValueError: unknown data source; the message lists the known ones.
        """
        try:
            return self.specs[data_source]
        except (KeyError, TypeError):
            raise _unknown(data_source, self.sources()) from None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs
) -> float | dict[str, Any]:
    """Score ``solution_str`` with the scorer registered for ``data_source``.

    ``kwargs`` are passed to the scorer (e.g. ``method="flexible"`` for GSM8K).

    Raises:
        ValueError: unknown data source (listing the known ones); whatever the scorer raises.
    """
    return get_reward_spec(data_source).fn(solution_str, ground_truth, extra_info, **kwargs)
