"""Whether Transformer Engine is usable, decided the way megatron-core decides it.

megatron-core's ``gpt_layer_specs`` builds the TE layer spec only when its own TE imports
succeed: ``transformer_engine``, its extension modules (``TEFusedMLP``, ``TENorm``) and
``TESpecProvider`` (``HAVE_TE``). A bare ``import transformer_engine`` can succeed while
those fail (a TE build for another torch, a missing CUDA library), and then building the
TE spec crashes. :func:`transformer_engine_usable` asks megatron-core itself (``HAVE_TE``,
``TESpecProvider``, and building the spec once) and falls back to the local spec with one
warning line. The model builder (:mod:`megaflow.megatron.model`) and the dry-run planner
(fused attention or not) use this one decision; it lives under ``megaflow.topology`` (what
a config implies about the machine) so that the planner can use it.
"""
from __future__ import annotations

import functools
import importlib.util
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _megatron_te_problem() -> str | None:
    """Why megatron-core would not build its TE layer spec here (None: it would)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine is not installed"
    try:
        from megatron.core.models.gpt import gpt_layer_specs as specs

        if not getattr(specs, "HAVE_TE", False) or not hasattr(specs, "TESpecProvider"):
            return "megatron-core could not import Transformer Engine's extension (HAVE_TE is False)"
        specs.get_gpt_layer_with_transformer_engine_spec()
    except Exception as exc:  # noqa: BLE001 - a broken TE: the local spec instead
        return f"megatron-core's TE layer spec failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def transformer_engine_usable(*, need_cuda: bool = True) -> bool:
    """True when megatron-core can build its Transformer Engine layer spec in this process.

    Args:
        need_cuda: also require a CUDA device here (the model builder); False for the
            planner of a GPU run, which may plan on a machine without a GPU.

    Returns:
        False without CUDA (when ``need_cuda``; silently), or when TE is missing or broken
        (one warning line per process naming why: the local spec is used).
    """
    if need_cuda:
        import torch  # only the model builder asks: topology stays importable without torch

        if not torch.cuda.is_available():
            return False
    problem = _megatron_te_problem()
    if problem is not None:
        _warn_once(problem)
    return problem is None


@functools.cache
def _warn_once(problem: str) -> None:
    logger.warning("Transformer Engine not usable (%s): using megatron-core's local layer spec, unfused attention",
                   problem)


__all__ = ["transformer_engine_usable"]
