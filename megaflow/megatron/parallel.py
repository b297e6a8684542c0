"""Megatron parallel state: the ONLY megaflow module that touches ``megatron.core.parallel_state``.

megaflow's own code receives a :class:`ParallelInfo` (ranks, sizes and process groups) and
passes its groups explicitly to the collectives it calls. megatron-core itself (its models,
optimizer and pipeline schedules) still reads the process-global state that
:func:`initialize_parallel` sets up, so a process holds one Megatron mesh: roles colocated
in one process must share it (checked at load, ``megaflow.topology.validate``).

Rank order is Megatron's default ``tp-cp-ep-dp-pp``: TP fastest, then CP, then DP, then PP.
So on 8 ranks with tp=2, pp=2 (dp=2): TP groups {0,1} {2,3} {4,5} {6,7}, DP groups {0,2}
{1,3} {4,6} {5,7}, PP groups {0,4} {1,5} {2,6} {3,7}.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megaflow.megatron import cpu_compat
from megaflow.utils.device import pin_local_rank

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the Megatron TP x CP x DP x PP mesh, with its process groups.

    ``dp_rank``/``dp_size`` are data parallel without context parallel (the ND-dispatch
    ``dp_rank``); ``dp_cp_group`` is the group Megatron reduces gradients over.
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    vpp_size: int | None
    tp_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    pp_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    dp_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    dp_cp_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    cp_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    model_parallel_group: ProcessGroup = dataclasses.field(repr=False, compare=False)
    pp_ranks: tuple[int, ...] = ()  # global ranks of this rank's PP group, stage order
    # Expert parallelism (issue 34): experts split over ep ranks, which are DP ranks of the
    # dense part; ``expert_dp_*`` is the DP group of the expert parameters (dp*cp*tp / (ep*etp)).
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_rank: int = 0
    ep_group: ProcessGroup | None = dataclasses.field(default=None, repr=False, compare=False)
    expert_dp_group: ProcessGroup | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def is_first_pp_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def last_pp_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's PP group."""
        return self.pp_ranks[-1]


def validate_parallel_sizes(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1,
                            vpp: int | None = None, dp: int | None = None) -> int:
    """Check a TP x PP x CP (x DP) layout against a world size; return the DP size.

    Pure (no process groups), so callers can validate before anything can hang.

    Raises:
        ValueError: a size below 1, ``world_size`` not divisible by ``tp*pp*cp``, a given
            ``dp`` with ``tp*pp*cp*dp != world_size``, or ``vpp`` without ``pp > 1``.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = "
            f"{model_parallel}")
    derived_dp = world_size // model_parallel
    if dp is not None and dp != derived_dp:
        raise ValueError(
            f"world size {world_size} != tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = "
            f"{model_parallel * dp}")
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 1:
            raise ValueError(f"vpp must be None or an integer >= 1, got {vpp!r}")
        if vpp > 1 and pp == 1:
            raise ValueError(f"vpp={vpp} (virtual pipeline) needs pp > 1, got pp=1")
    return derived_dp


def _set_cuda_device() -> None:
    """Bind this process to its CUDA device: the one Ray made visible (index 0), or
    ``$LOCAL_RANK`` among several visible ones (:func:`megaflow.utils.device.pin_local_rank`)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(pin_local_rank())


def _current_info() -> ParallelInfo:
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return ParallelInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=False),
        dp_size=ps.get_data_parallel_world_size(with_context_parallel=False),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        vpp_size=vpp,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_group=ps.get_context_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        pp_ranks=tuple(dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
    )


def initialize_parallel(tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None,
                        *, dp: int | None = None, ep: int = 1, seed: int = 1234,
                        timeout_minutes: int = 30) -> ParallelInfo:
    """Initialise Megatron's model-parallel state on the existing default process group.

    The default group must exist (``megaflow.utils.launch.run_distributed`` or
    ``Worker.init_distributed()``). Also applies the CPU accommodations
    (:mod:`megaflow.megatron.cpu_compat`) and seeds Megatron's RNG (same ``seed`` on all
    ranks). Calling it again with the same sizes returns the current info; other sizes
    raise.

    Args:
        tp: tensor parallel size (must divide attention heads; checked by the model builder).
        pp: pipeline parallel size.
        cp: context parallel size (validated and initialised; the engine supports cp=1).
        vpp: virtual pipeline stages per rank (None for no interleaving).
        dp: expected data parallel size; when given, ``tp*pp*cp*dp`` must equal the world.
        ep: expert parallel size (mixture-of-experts models): must divide ``dp*cp``
            (megatron-core carves the expert groups out of the data-parallel ranks).
        seed: base seed for Megatron's RNG streams.
        timeout_minutes: collective timeout for the groups Megatron creates.

    Returns:
        This rank's :class:`ParallelInfo`.

    Raises:
        RuntimeError: no default process group, or parallel state already initialised
            with different sizes.
        ValueError: sizes that do not fit the world (see :func:`validate_parallel_sizes`).
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("initialize_parallel needs the default process group; call "
                           "torch.distributed.init_process_group first")
    world = dist.get_world_size()
    dp_size = validate_parallel_sizes(world, tp, pp, cp, vpp, dp)
    if not isinstance(ep, int) or ep < 1 or (dp_size * cp) % ep:
        raise ValueError(f"ep={ep!r} must be an integer >= 1 dividing dp*cp = {dp_size}*{cp}")
    if ps.model_parallel_is_initialized():
        info = _current_info()
        wanted = (tp, pp, cp, dp_size, vpp if vpp and vpp > 1 else None, ep)
        have = (info.tp_size, info.pp_size, info.cp_size, info.dp_size, info.vpp_size, info.ep_size)
        if wanted != have:
            raise RuntimeError(
                f"Megatron parallel state is already initialised as (tp, pp, cp, dp, vpp, ep)="
                f"{have}; requested {wanted}. Call destroy_parallel() first.")
        return info
    cpu_compat.apply_cpu_accommodations()
    _set_cuda_device()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=cp, expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_minutes)
    cpu_compat.model_parallel_manual_seed(seed)
    return _current_info()


def current_parallel_info() -> ParallelInfo:
    """The :class:`ParallelInfo` of the initialised parallel state.

    Raises:
        RuntimeError: :func:`initialize_parallel` has not been called in this process.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is not initialised; call "
                           "megaflow.megatron.parallel.initialize_parallel() first")
    return _current_info()


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state (the default process group stays)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def nd_dispatch_info(info: ParallelInfo) -> tuple[int, bool]:
    """ND-compute dispatch registration for a training mesh (:func:`megaflow.single_controller.decorator.nd_compute`).

    Returns:
        ``(dp_rank, is_collect)``: the Megatron DP rank (without CP) and whether this rank's
        outputs are collected (``tp_rank == 0 and cp_rank == 0`` on the last PP stage).
    """
    return info.dp_rank, (info.tp_rank == 0 and info.cp_rank == 0 and info.is_last_pp_stage)


__all__ = ["ParallelInfo", "initialize_parallel", "current_parallel_info", "destroy_parallel", "nd_dispatch_info",
           "validate_parallel_sizes"]
