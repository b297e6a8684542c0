"""3D-HybridEngine execution: micro-DP all-gather resharding between training and generation.

Train -> generate (:meth:`MicroDPResharder.to_generation`), HybridFlow section 5 (the
layout and its cost: :mod:`megaflow.topology.hybrid_layout`), with ``m = t/t_g`` and ``k = p/p_g``:

1. For each TP-partitioned parameter of the rank's own stage, a flat generation buffer of
   ``m`` slots is allocated; slot ``micro_tp`` receives the training shard and the
   parameter's storage is *swapped* into it (``param.data`` becomes a view of the slot, the
   old storage is released), then one in-place all-gather over the gather group (the ``m``
   consecutive ranks of the training TP block that share a generation shard) fills the
   other slots. The training shard is therefore never held twice ("aliased"). Parameters
   whose storage is shared with something else (e.g. megatron DDP's contiguous
   ``param_data`` buffer under the distributed optimizer) cannot be moved: their shard
   is copied into the slot and the parameter keeps its storage ("copied").
2. When ``p_g < p``, every buffer (and every replicated tensor) of a folded stage is
   broadcast over the fold group (same ``tp_rank``, the ``k`` stages of one generation
   stage), so each rank holds all layers of its generation stage. Names use global layer
   indices (each stage's local indices offset by the layers of the stages before it,
   exchanged at construction, so uneven stages work).

The slot layout is the all-gather's natural one (``[m, *shard_shape]``). The megatron
TP = t_g shard is a zero-copy view of it for dim-0 partitioned tensors with stride 1 —
``linear_qkv`` (rows grouped per KV group, whole groups per rank, so consecutive shards
concatenate into a valid shard; with replicated KV heads, tp > HF num_kv_heads, each
replica is a megatron group like any other), embeddings, output layer — and is
materialised on demand for the others: ``linear_fc1`` (shards ``[gate_i; up_i]``
regrouped to ``[gate_all; up_all]`` of the generation shard) and row-parallel weights
(concatenated along dim 1). :meth:`named_generation_tensors` yields one tensor at a time so
the extra memory is at most one tensor. Treat the yielded tensors as read-only: views
alias the training parameters.

Generate -> train (:meth:`MicroDPResharder.to_training`): every aliased parameter gets a
standalone copy of its slot (bit-identical), and all generation buffers are dropped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from megaflow.topology.hybrid_layout import HybridLayout

from .params import LocalParam, count_local_layers, describe_local_params, local_expert_index, with_expert_index

__all__ = ["ReshardGroups", "build_reshard_groups", "ReshardStats", "MicroDPResharder", "PendingTensor",
           "gather_layout_to_shard"]

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class ReshardGroups:
    """This rank's process groups of the HybridEngine (None where the group has 1 rank)."""

    layout: HybridLayout
    rank: int
    gather: dist.ProcessGroup | None   # m ranks: all-gather along the partition dim
    fold: dist.ProcessGroup | None     # k ranks: broadcast of folded pipeline stages
    gen_tp: dist.ProcessGroup | None   # t_g ranks: the generation TP group
    ep: dist.ProcessGroup | None = None  # ep ranks: broadcast of each rank's experts


def build_reshard_groups(layout: HybridLayout, *, backend: str | None = None) -> ReshardGroups:
    """Create the gather, fold and generation-TP groups of ``layout`` (collective).

    Every rank of the default process group must call this once, at the same point: every
    rank creates every group in the same order (``torch.distributed.new_group``). Groups
    of a single rank are not created.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the world size differs from ``tp * pp * dp``.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_reshard_groups needs an initialised torch.distributed world")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != tp*pp*dp = {layout.tp}*"
                         f"{layout.pp}*{layout.dp} = {layout.world_size}")
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup | None] = {}
    for kind, groups in (("gather", layout.gather_groups), ("fold", layout.fold_groups),
                         ("gen_tp", layout.gen_tp_groups), ("ep", layout.ep_groups)):
        mine[kind] = None
        for ranks in groups:
            if len(ranks) > 1:
                group = dist.new_group(list(ranks), backend=backend)
                if rank in ranks:
                    mine[kind] = group
    return ReshardGroups(layout=layout, rank=rank, **mine)


@dataclasses.dataclass(frozen=True)
class ReshardStats:
    """What one train -> generate transition cost this rank (bytes, seconds).

    ``bytes_received``: data this rank did not hold before (all-gather slots of its peers,
    broadcast buffers of folded stages); equals
    :func:`~megaflow.topology.hybrid_layout.reshard_cost`'s ``(t*p - t_g*p_g)/(t_g*p_g*t*p) * M`` when every parameter
    is TP-partitioned and the
    stages are equal. ``bytes_sent``: this rank's data counted once per receiving peer
    (summed over ranks it equals the total received). ``generation_bytes``: weights held
    in the generation layout (the paper's peak weight memory ``M/(t_g*p_g)``).
    ``peak_extra_bytes``: peak of allocated buffers minus training storage released by
    aliasing, during the transition (materialised fc1/row-parallel tensors not included:
    at most one tensor at a time). ``expert_bytes_received``: the part of ``bytes_received``
    that is mixture-of-experts expert weights (streamed route;
    :func:`~megaflow.topology.hybrid_layout.expert_sync_bytes_received` states it).
    """

    bytes_sent: int
    bytes_received: int
    generation_bytes: int
    peak_extra_bytes: int
    num_aliased: int
    num_copied: int
    num_collectives: int
    seconds: float
    expert_bytes_received: int = 0


def gather_layout_to_shard(buffer: torch.Tensor, shard_shape: tuple[int, ...], dim: int,
                           stride: int, num_slots: int) -> torch.Tensor:
    """Regroup ``num_slots`` consecutive TP shards into the shard of the coarser TP.

    Args:
        buffer: flat ``[num_slots * prod(shard_shape)]``, slot ``i`` = TP shard ``i`` of
            the group (the all-gather output).
        shard_shape: one training shard's shape; ``dim`` its partition dim, ``stride`` the
            number of interleaved blocks along it (2 for SwiGLU ``linear_fc1``).

    Returns:
        ``shard_shape`` with ``dim`` multiplied by ``num_slots``: per block, the slots'
        chunks in slot order. A view when ``dim == 0 and stride == 1`` (or one slot),
        otherwise a new tensor.
    """
    shape = list(shard_shape)
    chunk = shape[dim] // stride
    x = buffer.view(num_slots, *shape[:dim], stride, chunk, *shape[dim + 1:])
    x = x.movedim(0, dim + 1)  # [*shape[:dim], stride, num_slots, chunk, *shape[dim+1:]]
    shape[dim] *= num_slots
    return x.reshape(shape)


def _owns_storage(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is the whole of its storage (so swapping it out frees memory)."""
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A generation tensor not gathered yet (:meth:`MicroDPResharder.stream_generation_tensors`).

    ``shape`` and ``dtype`` are the generation tensor's (TP = t_g shard); :meth:`fetch`
    runs its collectives and returns it (a view of a fresh buffer, or a regrouped copy).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of the generation tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class _GenEntry:
    meta: LocalParam       # metadata of the source stage's rank with this rank's tp_rank
    buffer: torch.Tensor   # flat, gather layout
    num_slots: int


class _Accounting:
    def __init__(self):
        self.sent = self.received = self.collectives = self.expert_received = 0
        self.current = self.peak = self.held = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        self.current -= nbytes


class MicroDPResharder:
    """Reshard one rank's actor parameters between the training and generation layouts.

    Construction is collective over the actor's world (it exchanges per-stage layer
    counts and, across folded stages, parameter metadata). Use as::

        layout = plan_hybrid_layout(tp, pp, dp, gen_tp, gen_pp, ...)
        resharder = MicroDPResharder(build_reshard_groups(layout), dict(model.named_parameters()))
        with resharder.generation() as stats:       # train -> generate
            for name, tensor in resharder.named_generation_tensors():
                ...                                 # push into the rollout engine
        # generate -> train: training parameters restored, buffers freed

    Args:
        groups: from :func:`build_reshard_groups`.
        named_params: this rank's parameters (megatron-core GPTModel names, local layer
            indices, e.g. ``dict(model.named_parameters())``); plain tensors work too.
        gated_linear_unit: SwiGLU ``linear_fc1`` (``[gate; up]`` per rank) when the
            tensors carry no megatron attributes.
        share_embeddings_and_output_weights: tied embeddings; with p_g == 1 the
            last stage's ``output_layer.weight`` copy is not part of the generation shard.
        merged: ``{name in named_params: fn}`` for weights the generation layout takes from
            ``fn()`` instead of the parameter (this rank's shard, same shape; LoRA's merged
            ``W + s B A``, :func:`megaflow.megatron.lora.weight_sync_sources`), computed one
            tensor at a time when that weight is gathered; the parameter is never aliased.

    Raises:
        ValueError: inconsistent parameter lists within a gather group or per stage,
            a fused layout that contradicts megatron's attributes (see ``params.py``).
    """

    def __init__(self, groups: ReshardGroups, named_params: Mapping[str, torch.Tensor], *,
                 gated_linear_unit: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 merged: Mapping[str, Callable[[], torch.Tensor]] | None = None):
        self.groups = groups
        self._merged = dict(merged or {})
        unknown = sorted(set(self._merged) - set(named_params))
        if unknown:
            raise ValueError(f"merged weights {unknown[:4]} are not among the named parameters")
        self.layout = layout = groups.layout
        self.placement = me = layout.ranks[groups.rank]
        self._params = dict(named_params)
        self.layers_per_stage = self._exchange_layer_counts()
        offset = sum(self.layers_per_stage[: me.pp_rank])
        local = describe_local_params(self._params, tp=layout.tp, layer_offset=offset,
                                      gated_linear_unit=gated_linear_unit)
        self._check_gather_group_agrees(local)
        stage_params = self._exchange_fold_metadata(local)
        tied_skip = share_embeddings_and_output_weights and layout.gen_pp == 1
        self._stage_params: dict[int, list[LocalParam]] = {
            s: [p for p in params if not (tied_skip and p.name == "output_layer.weight")]
            for s, params in sorted(stage_params.items())}
        self._entries: dict[str, _GenEntry] | None = None
        self._aliased: list[torch.Tensor] = []
        self.last_stats: ReshardStats | None = None

    # -- construction helpers -----------------------------------------------------------

    def _exchange_layer_counts(self) -> tuple[int, ...]:
        counts: list = [None] * self.layout.world_size
        dist.all_gather_object(counts, (self.placement.pp_rank, count_local_layers(self._params)))
        per_stage: dict[int, int] = {}
        for rank, (stage, num) in enumerate(counts):
            if per_stage.setdefault(stage, num) != num:
                raise ValueError(f"ranks of pipeline stage {stage} disagree on their number of "
                                 f"layers ({per_stage[stage]} vs {num} on rank {rank})")
        return tuple(per_stage[s] for s in range(self.layout.pp))

    def _check_gather_group_agrees(self, local: list[LocalParam]) -> None:
        if self.groups.gather is None:
            return
        mine = [(p.name, p.shard_shape, p.dtype, p.partition_dim, p.stride) for p in local]
        theirs: list = [None] * self.layout.tp_ratio
        dist.all_gather_object(theirs, mine, group=self.groups.gather)
        for other in theirs:
            if other != mine:
                diff = sorted(set(map(str, other)) ^ set(map(str, mine)))[:4]
                raise ValueError("ranks of one gather group (same stage, same generation "
                                 f"shard) hold different parameter lists, e.g. {diff}")

    def _exchange_fold_metadata(self, local: list[LocalParam]) -> dict[int, list[LocalParam]]:
        stage = self.placement.pp_rank
        if self.groups.fold is None:
            return {stage: local}
        gathered: list = [None] * self.layout.pp_ratio
        dist.all_gather_object(gathered, (stage, local), group=self.groups.fold)
        out = dict(gathered)
        names = [p.name for params in out.values() for p in params]
        if len(names) != len(set(names)):
            dup = sorted({n for n in names if names.count(n) > 1})[:4]
            raise ValueError(f"folded pipeline stages share parameter names {dup}")
        return out

    # -- transitions --------------------------------------------------------------------

    @property
    def in_generation(self) -> bool:
        """True between :meth:`to_generation` and :meth:`to_training`."""
        return self._entries is not None

    def to_generation(self) -> ReshardStats:
        """Train -> generate: gather and fold the generation shard (collective).

        Returns:
            The :class:`ReshardStats` of this transition (also in ``last_stats``).

        Raises:
            RuntimeError: already in the generation layout.
        """
        if self._entries is not None:
            raise RuntimeError("to_generation called twice without to_training in between")
        if self.layout.ep > 1:
            raise ValueError(f"to_generation gathers this rank's own parameters only; with expert parallelism "
                             f"(ep={self.layout.ep}) the other ranks' experts come through "
                             "stream_generation_tensors (the weight sync's route)")
        start = time.perf_counter()
        acc = _Accounting()
        self._entries = entries = dict[str, _GenEntry]()
        try:
            num_aliased = self._gather_own_stage(entries, acc)
            self._fold_stages(entries, acc)
            self._synchronize()
        except BaseException:
            self.to_training()  # give aliased parameters their storage back before raising
            raise
        held = sum(e.buffer.numel() * e.buffer.element_size() for e in entries.values())
        num_partitioned_own = sum(p.partition_dim is not None and self.layout.tp_ratio > 1
                                  for p in self._stage_params[self.placement.pp_rank])
        self.last_stats = ReshardStats(
            bytes_sent=acc.sent, bytes_received=acc.received, generation_bytes=held,
            peak_extra_bytes=acc.peak, num_aliased=num_aliased,
            num_copied=num_partitioned_own - num_aliased, num_collectives=acc.collectives,
            seconds=time.perf_counter() - start)
        return self.last_stats

    def _gather_own_stage(self, entries: dict[str, _GenEntry], acc: _Accounting) -> int:
        m, micro = self.layout.tp_ratio, self.placement.tp_rank % self.layout.tp_ratio
        works, num_aliased = [], 0
        for meta in self._stage_params[self.placement.pp_rank]:
            param, merged = self._params[meta.local_name], meta.local_name in self._merged
            if meta.partition_dim is None or m == 1:
                entries[meta.name] = _GenEntry(meta, _flat_view(self._source(meta), acc), 1)
                continue
            n, nbytes = meta.shard_numel, meta.shard_nbytes
            buffer = torch.empty(m * n, dtype=param.dtype, device=param.device)
            acc.alloc(m * nbytes)
            slot = buffer[micro * n:(micro + 1) * n]
            slot.copy_(self._source(meta).reshape(-1))
            if not merged and _owns_storage(param.data):
                param.data = slot.view(meta.shard_shape)
                self._aliased.append(param)
                acc.release(nbytes)
                num_aliased += 1
            works.append(_all_gather_flat(buffer, slot, group=self.groups.gather, async_op=True))
            acc.sent += (m - 1) * nbytes
            acc.received += (m - 1) * nbytes
            acc.collectives += 1
            entries[meta.name] = _GenEntry(meta, buffer, m)
        for work in works:
            work.wait()
        return num_aliased

    def _fold_stages(self, entries: dict[str, _GenEntry], acc: _Accounting) -> None:
        if self.groups.fold is None:
            return
        me, layout, works = self.placement, self.layout, []
        device = next(iter(self._params.values())).device if self._params else "cpu"
        for stage in layout.training_stages_of(me.gen_pp_rank):
            src = layout.rank_of(me.tp_rank, stage, me.dp_rank)
            for meta in self._stage_params[stage]:
                slots = layout.tp_ratio if meta.partition_dim is not None else 1
                nbytes = slots * meta.shard_nbytes
                if stage == me.pp_rank:
                    buffer = entries[meta.name].buffer
                    acc.sent += (layout.pp_ratio - 1) * nbytes
                else:
                    buffer = torch.empty(slots * meta.shard_numel, dtype=meta.dtype, device=device)
                    acc.alloc(nbytes)
                    acc.received += nbytes
                    entries[meta.name] = _GenEntry(meta, buffer, slots)
                works.append(dist.broadcast(buffer, src=src, group=self.groups.fold,
                                            async_op=True))
                acc.collectives += 1
        for work in works:
            work.wait()

    def _synchronize(self) -> None:
        if any(p.is_cuda for p in self._params.values()):
            torch.cuda.synchronize()

    def to_training(self) -> None:
        """Generate -> train: give aliased parameters their own storage, free the buffers.

        Raises:
            RuntimeError: not in the generation layout.
        """
        if self._entries is None:
            raise RuntimeError("to_training called while not in the generation layout")
        for param in self._aliased:
            param.data = param.data.clone(memory_format=torch.contiguous_format)
        self._aliased = []
        self._entries = None

    @contextlib.contextmanager
    def generation(self) -> Iterator[ReshardStats]:
        """``with resharder.generation() as stats:`` train -> generate ... -> train."""
        stats = self.to_generation()
        try:
            yield stats
        finally:
            self.to_training()

    # -- the streamed transition (the weight sync's route) -----------------------------

    def stream_generation_tensors(self) -> Iterator[tuple[str, PendingTensor]]:
        """Yield ``(global megatron name, PendingTensor)`` for the generation shard, nothing
        gathered ahead (collective: see below).

        Unlike :meth:`to_generation` nothing is gathered before it is needed: a parameter's
        all-gather (and fold broadcast) runs when the consumer calls
        :meth:`PendingTensor.fetch`, into a buffer of its own that lives only as long as
        the consumer keeps the fetched tensor (or a view of it), so the consumer can make
        room (hand out a bucket) before the tensor exists. The training parameters keep
        their storage (no aliasing). With a consumer that drops each bucket after loading
        it, the sync's extra memory is one bucket plus one generation tensor in
        conversion: the weight sync's peak is the actor's shard + the engine's weights +
        one bucket + the largest generation tensor
        (:func:`~megaflow.topology.weight_sync.weight_sync_peak_bytes`).

        Collective: every rank iterates to the end, in the same order, and fetches the
        same names as the other ranks of its gather, fold and expert-parallel groups (a name
        may be left unfetched on all of them, e.g. a tied output layer). After the last item,
        ``last_stats`` holds this sync's :class:`ReshardStats` (``peak_extra_bytes``: the
        largest buffer fetched; ``generation_bytes``: bytes fetched; ``num_aliased`` 0).

        Mixture-of-experts experts (``...mlp.experts.local_experts.{e}...``) are yielded
        under *global* expert indices, every expert of the model: with ``ep > 1`` each
        local expert ``e`` of the stage becomes ``ep`` items, ``o * E_local + e`` for EP rank
        ``o``; the owner gathers it like any parameter (TP all-gather, fold broadcast) and
        broadcasts the generation shard over its EP group
        (:attr:`~megaflow.topology.hybrid_layout.HybridLayout.ep_groups`), so each rank
        receives ``M_E / (t_g*p_g) - M_E / (ep*t*p)`` bytes of experts
        (:func:`~megaflow.topology.hybrid_layout.expert_sync_bytes_received`).

        Raises:
            RuntimeError: called while in the generation layout (:meth:`to_generation`).
        """
        if self._entries is not None:
            raise RuntimeError("stream_generation_tensors called between to_generation and to_training")
        start = time.perf_counter()
        acc = _Accounting()
        fetched: list[int] = []

        def fetch_of(stage: int, meta: LocalParam, owner: int | None):
            def fetch() -> torch.Tensor:
                received = acc.received
                if owner is None:
                    buffer, slots, allocated = self._gather_one(stage, meta, acc)
                else:
                    buffer, slots, allocated = self._gather_expert(stage, meta, owner, acc)
                if local_expert_index(meta.name) is not None:
                    acc.expert_received += acc.received - received
                fetched.append(allocated)
                acc.held += buffer.numel() * buffer.element_size()
                if meta.partition_dim is None:
                    return buffer.view(meta.shard_shape)
                return gather_layout_to_shard(buffer, meta.shard_shape, meta.partition_dim, meta.stride, slots)
            return fetch

        for stage, params in self._stage_params.items():
            for meta in params:
                for name, owner in self._expert_copies(meta):
                    yield name, PendingTensor(self._generation_shape(meta), meta.dtype, fetch_of(stage, meta, owner))
                    while fetched:  # the consumer asked for the next one: that buffer is its own now
                        acc.release(fetched.pop())
        own = self._stage_params[self.placement.pp_rank]
        self.last_stats = ReshardStats(
            bytes_sent=acc.sent, bytes_received=acc.received, generation_bytes=acc.held, peak_extra_bytes=acc.peak,
            num_aliased=0, num_copied=sum(p.partition_dim is not None and self.layout.tp_ratio > 1 for p in own),
            num_collectives=acc.collectives, seconds=time.perf_counter() - start,
            expert_bytes_received=acc.expert_received)

    def _experts_per_rank(self) -> int:
        """Local experts per MoE layer on every rank (0 for a dense model)."""
        indices = [local_expert_index(p.name) for params in self._stage_params.values() for p in params]
        return 1 + max((i for i in indices if i is not None), default=-1)

    def _expert_copies(self, meta: LocalParam) -> list[tuple[str, int | None]]:
        """``(global name, owning EP rank)`` of the generation tensors one parameter yields: the
        parameter itself (owner None) unless it is an expert and ``ep > 1``, then one per EP
        rank, renamed to the global expert index."""
        local = local_expert_index(meta.name)
        if local is None or self.layout.ep == 1:
            return [(meta.name, None)]
        per_rank = self._experts_per_rank()
        return [(with_expert_index(meta.name, owner * per_rank + local), owner) for owner in range(self.layout.ep)]

    def _gather_expert(self, stage: int, meta: LocalParam, owner: int,
                       acc: _Accounting) -> tuple[torch.Tensor, int, int]:
        """The generation buffer of EP rank ``owner``'s copy of expert parameter ``meta``: the
        owner gathers its own (:meth:`_gather_one`), then broadcasts it over the EP group."""
        layout, me = self.layout, self.placement
        slots = layout.tp_ratio if meta.partition_dim is not None else 1
        nbytes = slots * meta.shard_nbytes
        if me.ep_rank == owner:
            buffer, slots, allocated = self._gather_one(stage, meta, acc)  # the broadcast's root only reads it
            acc.sent += (layout.ep - 1) * nbytes
        else:
            buffer, allocated = self._receive_buffer(meta, slots, acc)
        group_ranks = next(g for g in layout.ep_groups if me.rank in g)
        dist.broadcast(buffer, src=group_ranks[owner], group=self.groups.ep)
        acc.collectives += 1
        return buffer, slots, allocated

    def _receive_buffer(self, meta: LocalParam, slots: int, acc: _Accounting) -> tuple[torch.Tensor, int]:
        """An empty flat buffer for ``slots`` shards of ``meta`` that a peer sends (counted as
        allocated and received): ``(buffer, bytes)``."""
        device = next(iter(self._params.values())).device if self._params else "cpu"
        nbytes = slots * meta.shard_nbytes
        acc.alloc(nbytes)
        acc.received += nbytes
        return torch.empty(slots * meta.shard_numel, dtype=meta.dtype, device=device), nbytes

    def _source(self, meta: LocalParam) -> torch.Tensor:
        """This rank's training shard of ``meta``: the parameter, or its merged weight."""
        merge = self._merged.get(meta.local_name)
        if merge is None:
            return self._params[meta.local_name].data
        tensor = merge()
        if tuple(tensor.shape) != meta.shard_shape or tensor.dtype != meta.dtype:
            raise ValueError(f"{meta.local_name}: the merged weight is {tuple(tensor.shape)} {tensor.dtype}, the "
                             f"parameter {meta.shard_shape} {meta.dtype}")
        return tensor

    def _generation_shape(self, meta: LocalParam) -> tuple[int, ...]:
        shape = list(meta.shard_shape)
        if meta.partition_dim is not None:
            shape[meta.partition_dim] *= self.layout.tp_ratio
        return tuple(shape)

    def generation_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{global megatron name: (shape, dtype)}`` of the generation shard, every expert under its
        global index (no collective)."""
        return {name: (self._generation_shape(p), p.dtype) for params in self._stage_params.values() for p in params
                for name, _ in self._expert_copies(p)}

    def _gather_one(self, stage: int, meta: LocalParam, acc: _Accounting) -> tuple[torch.Tensor, int, int]:
        """One parameter's generation buffer (gather layout): ``(flat buffer, slots, bytes allocated)``."""
        layout, me = self.layout, self.placement
        slots = layout.tp_ratio if meta.partition_dim is not None else 1
        nbytes = slots * meta.shard_nbytes
        if stage == me.pp_rank:
            param = self._source(meta)
            if slots == 1:
                allocated = 0 if param.is_contiguous() and meta.local_name not in self._merged else nbytes
                buffer = _flat_view(param, acc)
            else:
                buffer = torch.empty(slots * meta.shard_numel, dtype=param.dtype, device=param.device)
                acc.alloc(nbytes)
                allocated = nbytes
                micro = me.tp_rank % slots
                slot = buffer[micro * meta.shard_numel:(micro + 1) * meta.shard_numel]
                slot.copy_(param.reshape(-1))
                _all_gather_flat(buffer, slot, group=self.groups.gather)
                acc.sent += (slots - 1) * meta.shard_nbytes
                acc.received += (slots - 1) * meta.shard_nbytes
                acc.collectives += 1
            if self.groups.fold is not None:
                acc.sent += (layout.pp_ratio - 1) * nbytes
        else:
            buffer, allocated = self._receive_buffer(meta, slots, acc)
        if self.groups.fold is not None:
            dist.broadcast(buffer, src=layout.rank_of(me.tp_rank, stage, me.dp_rank), group=self.groups.fold)
            acc.collectives += 1
        return buffer, slots, allocated

    # -- the generation shard -----------------------------------------------------------

    def generation_names(self) -> list[str]:
        """Global megatron names of this rank's generation shard, in stage/param order."""
        return [p.name for params in self._stage_params.values() for p in params]

    def generation_tensor(self, name: str) -> torch.Tensor:
        """The megatron TP = t_g shard of parameter ``name`` (global layer index).

        Raises:
            RuntimeError: not in the generation layout.
            KeyError: ``name`` is not in this rank's generation shard.
        """
        if self._entries is None:
            raise RuntimeError("generation tensors exist only between to_generation and "
                               "to_training")
        if name not in self._entries:
            raise KeyError(f"{name!r} is not in this rank's generation shard; it holds "
                           f"{len(self._entries)} tensors, e.g. {list(self._entries)[:3]}")
        entry = self._entries[name]
        meta = entry.meta
        if meta.partition_dim is None:
            return entry.buffer.view(meta.shard_shape)
        return gather_layout_to_shard(entry.buffer, meta.shard_shape, meta.partition_dim,
                                      meta.stride, entry.num_slots)

    def named_generation_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(global megatron name, TP = t_g shard)`` for the whole generation shard.

        Names are megatron-core GPTModel names with global layer indices
        (:mod:`megaflow.hybrid_engine.rollout_weights` maps them to vLLM's). Regrouped
        tensors are built one per step, when the consumer asks for them.
        """
        for name in self.generation_names():
            yield name, self.generation_tensor(name)


def _flat_view(tensor: torch.Tensor, acc: _Accounting) -> torch.Tensor:
    """A flat view of ``tensor`` (a contiguous copy, counted as allocated, if it has none)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    acc.alloc(tensor.numel() * tensor.element_size())
    return tensor.contiguous().view(-1)
