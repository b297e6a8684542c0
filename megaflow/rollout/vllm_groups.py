"""Which global ranks form the tensor-parallel group of each SPMD vLLM engine.

How vLLM derives its groups (read from vLLM 0.32's ``vllm/distributed/parallel_state.py``
and ``vllm/v1/executor/uniproc_executor.py``): with
``distributed_executor_backend="external_launcher"`` every rank builds its own engine with
one in-process worker whose rank is ``$RANK`` in the *existing* default process group
(``$LOCAL_RANK`` picks the device). The worker calls ``init_distributed_environment``
(a no-op for the world, which already exists, apart from wrapping it) and then
``ensure_model_parallel_initialized(tp, pp, ...)``, which calls
``initialize_model_parallel`` *only if* vLLM's TP and PP groups do not exist yet. That
function lays ``arange(world_size)`` out as ``ExternalDP x DP x PP x PCP x TP`` (TP
fastest): the TP groups are always **consecutive global ranks**, ``[0..t-1], [t..2t-1],
...``, and every block of ``tp * pp`` ranks is one independent engine replica
("ExternalDP"). There is no engine argument that names the group ranks.

HybridFlow's generation TP groups are strided inside each training TP block (stride
``t / t_g``; see :mod:`megaflow.topology.hybrid_layout`, ``HybridLayout.gen_tp_groups``),
and Megatron's training TP groups must stay consecutive, so the rollout side adapts:
:func:`prepare_vllm_tp_groups` creates vLLM's process groups itself (TP groups as given,
PP/PCP/DCP/DP groups of one rank each) *before* the engine is built, so that
``ensure_model_parallel_initialized`` finds them and only checks their sizes. This is
what verl did for vLLM <= 0.6 with its patched ``parallel_state``. It touches vLLM's
module-level group registry (``_TP``, ``_PP``, ...), so :func:`verify_vllm_tp_group`
checks after engine creation that vLLM really uses the requested ranks; a vLLM upgrade
that changes this path fails loudly there instead of generating with mismatched shards.

Requirements on the groups: they partition ``range(world_size)``, each has ``tp_size``
ranks in **ascending** order (``torch.distributed.new_group`` orders members by global
rank, while vLLM takes a rank's TP rank from its index in the list; so generation TP rank
``i`` must be the ``i``-th smallest global rank of its group, which HybridFlow's strided
groups satisfy). One engine layout per process (vLLM's groups are process-global). Own groups
are for dense models only: vLLM builds a mixture-of-experts model's expert-parallel group
(``_EP``, the DP x PCP x TP ranks of an engine) only in its own ``initialize_model_parallel``,
so an MoE engine must use vLLM's consecutive groups (generation TP = training TP, the only
layout on CPU, where MoE training runs at TP = 1); :func:`prepare_vllm_tp_groups` refuses
the other case.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch.distributed as dist

from megaflow.utils.device import pin_local_rank


def consecutive_tp_groups(world_size: int, tp_size: int) -> list[list[int]]:
    """vLLM's default TP groups: ``[[0..tp-1], [tp..2tp-1], ...]``."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"world_size={world_size} is not a multiple of the rollout tp_size={tp_size}")
    return [list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)]


def validate_tp_groups(tp_group_ranks: Sequence[Sequence[int]], world_size: int,
                       tp_size: int) -> list[list[int]]:
    """Check that ``tp_group_ranks`` is a usable set of vLLM TP groups; return it as lists.

    Raises:
        ValueError: a group of the wrong size, not ascending, ranks outside
            ``range(world_size)``, or groups that do not partition the world.
    """
    groups = [[int(r) for r in g] for g in tp_group_ranks]
    for g in groups:
        if len(g) != tp_size:
            raise ValueError(f"tp_group_ranks: group {g} has {len(g)} ranks, expected tp_size={tp_size}")
        if g != sorted(set(g)):
            raise ValueError(f"tp_group_ranks: group {g} must list distinct global ranks in ascending order "
                             f"(generation TP rank i = i-th smallest rank; torch orders group members "
                             f"by global rank)")
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"tp_group_ranks {groups} must partition the ranks 0..{world_size - 1} "
                         f"of the default process group exactly once")
    return groups


def _group_of(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


def prepare_vllm_tp_groups(tp_size: int, tp_group_ranks: Sequence[Sequence[int]] | None, *,
                           moe: bool = False) -> list[int]:
    """Arrange for the engine about to be built on this rank to use the requested TP group.

    Call on every rank of the default process group, in the same order, before building
    the engine (it may create process groups, a collective operation).

    Args:
        tp_size: the rollout's tensor-parallel size ``t_g``.
        tp_group_ranks: all TP groups of the world (global ranks, each ascending), e.g.
            ``HybridLayout.gen_tp_groups``; ``None`` means vLLM's consecutive groups.
        moe: the model has experts (then only vLLM's consecutive groups are accepted).

    Returns:
        This rank's TP group (global ranks); ``[0]`` when no process group exists.

    Raises:
        ValueError: ``tp_size > 1`` without an initialised default process group, bad
            groups (see :func:`validate_tp_groups`), or non-consecutive groups for an MoE model.
        RuntimeError: vLLM's groups already exist in this process with another layout.
    """
    if not dist.is_initialized():
        if tp_size != 1:
            raise ValueError(f"a tensor-parallel rollout (tp_size={tp_size}) needs an initialised "
                             f"torch.distributed default process group (one engine per rank)")
        if tp_group_ranks is not None:
            validate_tp_groups(tp_group_ranks, 1, 1)
        return [0]
    world_size, rank = dist.get_world_size(), dist.get_rank()
    default = consecutive_tp_groups(world_size, tp_size)
    groups = default if tp_group_ranks is None else validate_tp_groups(tp_group_ranks, world_size, tp_size)
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        existing = [list(g) for g in ps.get_tp_group().group_ranks]
        if existing != groups:
            raise RuntimeError(f"vLLM's process groups already exist in this process with TP groups "
                               f"{existing}; cannot build an engine with {groups} (one layout per process)")
    elif groups != default:
        if moe:
            raise ValueError(f"a mixture-of-experts rollout needs vLLM's consecutive TP groups {default}, got {groups} "
                             "(generation tp < training tp): megaflow creates no expert-parallel group for vLLM; "
                             "use rollout.tp equal to the actor's tp")
        _init_vllm_groups(groups, world_size, rank)
    return _group_of(groups, rank)


def _init_vllm_groups(groups: list[list[int]], world_size: int, rank: int) -> None:
    """Create vLLM's world, TP (= the given groups) and size-1 PP/PCP/DCP/DP groups."""
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    local_rank = pin_local_rank()  # vLLM builds its groups' device as cuda:{local_rank}
    # The CPU communicator names its shared-memory segment after this; the CPU worker sets it
    # from the init method later, but the TP group's communicator is created here.
    os.environ.setdefault("VLLM_DIST_IDENT", f"megaflow-{os.environ.get('MASTER_PORT', 'world')}")
    ps.init_distributed_environment(world_size, rank, "env://", local_rank, current_platform.dist_backend)
    backend = dist.get_backend(ps.get_world_group().device_group)
    singles = [[r] for r in range(world_size)]
    ps._TP = ps.init_model_parallel_group(groups, local_rank, backend, use_message_queue_broadcaster=True,
                                          group_name="tp")
    ps._ETP = ps._TP
    ps._DCP = ps.init_model_parallel_group(singles, local_rank, backend, use_message_queue_broadcaster=True,
                                           group_name="dcp")
    ps._PCP = ps.init_model_parallel_group(singles, local_rank, backend, group_name="pcp")
    ps._PP = ps.init_model_parallel_group(singles, local_rank, backend, group_name="pp")
    ps._DP = ps.init_model_parallel_group(singles, local_rank, backend, group_name="dp")


def verify_vllm_tp_group(expected_group: Sequence[int]) -> None:
    """Raise RuntimeError unless vLLM's TP group on this rank is ``expected_group`` (in order)."""
    if not dist.is_initialized() and list(expected_group) == [0]:
        return
    from vllm.distributed.parallel_state import get_tp_group

    actual = list(get_tp_group().ranks)
    if actual != list(expected_group):
        raise RuntimeError(f"vLLM built TP group {actual} on rank {dist.get_rank()}, expected "
                           f"{list(expected_group)}; the generation shards would not line up")


__all__ = ["consecutive_tp_groups", "validate_tp_groups", "prepare_vllm_tp_groups", "verify_vllm_tp_group"]
