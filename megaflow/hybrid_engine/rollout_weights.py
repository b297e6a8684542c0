"""Generation shards (Megatron names, TP = t_g) -> the tensors a vLLM engine loads, in buckets.

After :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.to_generation` every rank
holds its generation shard as megatron-core tensors with global layer names and the
Megatron layouts (``linear_qkv`` grouped per KV group, ``linear_fc1`` = [gate; up] of the
shard, vocabulary padded for the training TP). One route takes it into vLLM at every
t_g (t_g = 1 is the one-shard case): each tensor is renamed and re-laid out into the
engine's local shard (:func:`vllm_param_name`, :func:`to_vllm_shard`) and pushed in
buckets (:func:`iter_vllm_buckets`) through
:meth:`megaflow.rollout.vllm_rollout.VLLMRollout.load_weight_bucket`.

The name table is derived, not restated: the Megatron -> Hugging Face rows of
:mod:`megaflow.models.hf_mapping` give the HF names; vLLM keeps the HF names except for
the modules it packs (:data:`VLLM_PACKED_MODULES`, vLLM's own
``LlamaForCausalLM.packed_modules_mapping`` / ``Qwen2ForCausalLM.packed_modules_mapping``),
whose HF source tensors are exactly the ones a fused Megatron row joins. Layouts:

* ``linear_qkv`` (row transform ``"qkv"``): Megatron interleaves q, k, v per KV group,
  vLLM keeps all local q heads, then k, then v; rows are reordered
  (:func:`megaflow.models.transforms.megatron_qkv_to_vllm`).
* ``linear_fc1`` (``"gate_up"``): the shard ``[gate_local; up_local]`` is vLLM's
  ``gate_up_proj`` shard as it is; row-parallel weights and norms likewise.
* mixture-of-experts experts (Qwen3-MoE): the resharder yields each expert's TP = t_g shard
  under its *global* expert index (with ``ep > 1`` the owning EP rank broadcasts it,
  :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.stream_generation_tensors`); vLLM
  holds every expert of a layer in one fused parameter (:data:`VLLM_FUSED_EXPERTS`:
  ``w13_weight [E, 2*I/t_g, H]`` = per expert its ``[gate; up]`` shard, Megatron's ``linear_fc1``
  as it is; ``w2_weight [E, H, I/t_g]`` = its ``linear_fc2``), so :class:`ExpertStacks`
  places each expert at its index and hands the fused tensor to a bucket once complete. The
  router (``mlp.router`` -> ``mlp.gate``) and the q/k norms keep HF's names.
* vocabulary rows (``"vocab"``): Megatron pads the vocabulary to a multiple of
  ``128 * t`` and vLLM to a multiple of 64, so the row ranges per rank can differ; then
  every rank of the generation TP group sends each peer exactly the real rows of its
  Megatron range that fall in the peer's vLLM range (point-to-point,
  :func:`exchange_vocab_rows`): no rank ever holds more than its own Megatron rows and
  its vLLM rows (no full-vocabulary gather). Rows past the real vocabulary are zero.
  Where the paddings agree the shard is vLLM's as it is.

Memory: :func:`generation_buckets` gathers the generation shard one tensor at a time
(:meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.stream_generation_tensors`),
converts it and hands it out in buckets of at most ``bucket_bytes`` (a bucket is handed
out before the next tensor is converted). With a consumer that wakes the engine's weights
before asking for the first bucket and drops each bucket after loading it
(:func:`~megaflow.hybrid_engine.transport.load_buckets`), the sync's peak is the actor's
shard + the engine's weights + one bucket + one generation tensor being converted
(:mod:`megaflow.topology.weight_sync`; ``tools/bench_reshard.py`` and
``tools/bench_memory.py`` measure it).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from megaflow.models.hf_mapping import ModelSpec, find_mapping, local_expert
from megaflow.models.transforms import megatron_qkv_to_vllm

from .reshard import PendingTensor, _all_gather_flat

#: vLLM module that packs several HF modules -> the HF modules, in packing order
#: (vLLM 0.32 ``packed_modules_mapping`` of ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``;
#: tests/rollout checks the two tables are still these).
VLLM_PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: HF expert modules (``mlp.experts.{e}.<module>``) -> vLLM's fused-MoE parameter under
#: ``mlp.experts`` holding every expert of the layer (vLLM 0.32 ``Qwen3MoeSparseMoeBlock``:
#: ``MoERunner.routed_experts``, a ``RoutedExperts`` layer; ``w13_weight``
#: ``[experts, 2 * intermediate / t_g, hidden]`` = per expert the rank's gate rows then its up rows,
#: ``w2_weight`` ``[experts, hidden, intermediate / t_g]``).
VLLM_FUSED_EXPERTS: Mapping[tuple[str, ...], str] = {
    ("gate_proj", "up_proj"): "routed_experts.w13_weight",
    ("down_proj",): "routed_experts.w2_weight",
}


def vllm_param_name(megatron_name: str, spec: ModelSpec) -> str | None:
    """The vLLM parameter that receives a megatron-core generation-shard tensor.

    Args:
        megatron_name: megatron-core GPTModel name with a *global* layer index, e.g.
            ``decoder.layers.3.self_attention.linear_qkv.weight``.
        spec: the model spec (selects the active rows: QKV bias, head kind, tying).

    Returns:
        The vLLM name (e.g. ``model.layers.3.self_attn.qkv_proj.weight``), or None for a
        tied output layer (vLLM's ``lm_head`` shares the embedding's parameter).

    Raises:
        KeyError: a name outside the :mod:`~megaflow.models.hf_mapping` table, or a fused
            row whose HF modules vLLM does not pack into one parameter.
    """
    row, layer = find_mapping(megatron_name, spec)
    if row.tied_hf and spec.tie_word_embeddings:
        return None
    if row.per_expert:  # every expert of the layer lives in one fused vLLM parameter
        hf_expert = [name.format(layer=layer, expert=0) for name in row.hf]
        modules = tuple(name.rpartition(".")[0].rpartition(".")[2] for name in hf_expert)
        experts = hf_expert[0].rpartition(".")[0].rpartition(".")[0].rpartition(".")[0]
        if modules not in VLLM_FUSED_EXPERTS:
            raise KeyError(f"megatron expert parameter {megatron_name!r} (HF modules {modules}) has no fused vLLM "
                           f"parameter (known: {dict(VLLM_FUSED_EXPERTS)})")
        return f"{experts}.{VLLM_FUSED_EXPERTS[modules]}"
    hf = [name.format(layer=layer) for name in row.hf]
    if len(hf) == 1:
        return hf[0]
    prefix, _, param = hf[0].rpartition(".")
    parent, _, first_module = prefix.rpartition(".")
    modules = tuple(name.rpartition(".")[0].rpartition(".")[2] for name in hf)
    for packed, sources in VLLM_PACKED_MODULES.items():
        if sources == modules:
            return f"{parent}.{packed}.{param}"
    raise KeyError(f"megatron parameter {megatron_name!r} fuses HF modules {modules} that vLLM does not "
                   f"pack into one parameter (known: {dict(VLLM_PACKED_MODULES)})")


def gather_rows(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather ``shard`` along dim 0 over ``group`` into one new tensor (collective).

    Args:
        shard: ``[rows, ...]``, the same shape on every rank of ``group``.
        group: the generation TP group; None (t_g = 1): ``shard`` itself is returned.

    Returns:
        ``[group_size * rows, ...]``, rank ``i``'s rows at ``[i * rows, (i + 1) * rows)``
        (one output buffer, no per-rank copies).
    """
    if group is None:
        return shard
    out = shard.new_empty((dist.get_world_size(group) * shard.shape[0], *shard.shape[1:]))
    _all_gather_flat(out, shard.contiguous(), group=group)
    return out


def vocab_row_transfers(size: int, megatron_rows: int, vllm_rows: int,
                        vocab_size: int) -> list[tuple[int, int, int, int, int]]:
    """Which real vocabulary rows move between the ranks of a generation TP group.

    Rank ``s`` holds Megatron rows ``[s * megatron_rows, (s + 1) * megatron_rows)`` and rank
    ``d`` needs vLLM rows ``[d * vllm_rows, (d + 1) * vllm_rows)``, of which only those
    below ``vocab_size`` carry data (the rest are zero padding on vLLM's side).

    Returns:
        ``(src, dst, src_row, dst_row, count)`` for every non-empty overlap: rows
        ``src_row .. src_row + count`` of ``src``'s shard go to rows ``dst_row ..`` of
        ``dst``'s vLLM shard (local row indices), ordered by ``(src, dst)``.
    """
    moves = []
    for src in range(size):
        for dst in range(size):
            lo = max(src * megatron_rows, dst * vllm_rows)
            hi = min((src + 1) * megatron_rows, (dst + 1) * vllm_rows, vocab_size)
            if hi > lo:
                moves.append((src, dst, lo - src * megatron_rows, lo - dst * vllm_rows, hi - lo))
    return moves


def exchange_vocab_rows(shard: torch.Tensor, vllm_rows: int, vocab_size: int,
                        group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's vLLM vocabulary rows from the Megatron rows of the group (collective).

    Args:
        shard: ``[V_megatron / t_g, hidden]``, this rank's Megatron rows (the same shape on
            every rank of ``group``).
        vllm_rows: vLLM's rows per rank (its padded vocabulary / t_g).
        vocab_size: the real vocabulary size.
        group: the generation TP group; None at t_g = 1.

    Returns:
        ``[vllm_rows, hidden]``: rows ``[r * vllm_rows, (r + 1) * vllm_rows)`` of the real
        vocabulary for group rank ``r``, zero past ``vocab_size``. Only the overlapping
        rows move (:func:`vocab_row_transfers`, batched ``isend``/``irecv``); the memory
        used is the returned tensor.
    """
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    out = shard.new_zeros((vllm_rows, *shard.shape[1:]))
    ops = []
    for src, dst, src_row, dst_row, count in vocab_row_transfers(size, shard.shape[0], vllm_rows, vocab_size):
        rows_in, rows_out = shard[src_row:src_row + count], out[dst_row:dst_row + count]
        if src == rank == dst:
            rows_out.copy_(rows_in)
            continue
        assert group is not None  # (without a group the one rank keeps every row, above)
        if src == rank:
            ops.append(dist.P2POp(dist.isend, rows_in.contiguous(), dist.get_global_rank(group, dst), group))
        elif dst == rank:
            ops.append(dist.P2POp(dist.irecv, rows_out, dist.get_global_rank(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _vllm_vocab_rows(shard: torch.Tensor, vocab_size: int, rows_per_rank: int, rank: int,
                     exchange_vocab: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """vLLM's vocabulary rows ``[rank * rows_per_rank, (rank + 1) * rows_per_rank)``, zero
    beyond the real ``vocab_size`` rows, from this rank's Megatron rows ``shard``.

    When both paddings give a rank the same rows the shard is used as it is (no exchange;
    the decision depends on shapes only, so every rank of the group takes the same branch).
    """
    start = rank * rows_per_rank
    real = max(0, min(vocab_size, start + rows_per_rank) - start)
    if shard.shape[0] == rows_per_rank:
        if real == rows_per_rank:
            return shard
        out = shard.clone()
        out[real:] = 0
        return out
    return exchange_vocab(shard, rows_per_rank)


def to_vllm_shard(megatron_name: str, tensor: torch.Tensor, spec: ModelSpec, *, gen_tp: int, gen_tp_rank: int,
                  vllm_shapes: Mapping[str, tuple[int, ...]],
                  exchange_vocab: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """Rename and re-lay out one generation-shard tensor into this rank's vLLM shard.

    Args:
        megatron_name, tensor: one ``(global megatron name, TP = gen_tp shard)`` pair of
            :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.named_generation_tensors`.
        spec: head counts (QKV reorder) and the real vocabulary size.
        gen_tp, gen_tp_rank: generation TP size t_g and this rank's position in its group.
        vllm_shapes: vLLM name -> this rank's shard shape (the engine's
            :meth:`~megaflow.rollout.vllm_rollout.VLLMRollout.sharded_param_shapes`).
        exchange_vocab: ``(Megatron vocabulary shard [V_megatron / t_g, hidden], vLLM rows
            per rank) -> this rank's vLLM rows`` (collective over the generation TP group;
            :func:`exchange_vocab_rows`), called only where the two paddings differ.

    Returns:
        ``(vLLM name, shard)`` — a view of ``tensor`` where the layouts agree, a new tensor
        otherwise — or None for a tied output layer. For an expert (a *global* expert index in
        the name, as the resharder's stream yields it) the shard is that expert's slice of the
        fused vLLM parameter (``vllm_shapes[name][1:]``; :class:`ExpertStacks` joins them).

    Raises:
        KeyError: an unmapped name, or a vLLM name the engine does not have.
        ValueError: a converted shard whose shape differs from vLLM's (both named).
    """
    target = vllm_param_name(megatron_name, spec)
    if target is None:
        return None
    if target not in vllm_shapes:
        raise KeyError(f"vLLM has no parameter {target!r} (from {megatron_name!r})")
    row = find_mapping(megatron_name, spec)[0]
    shape = tuple(vllm_shapes[target])[1:] if row.per_expert else tuple(vllm_shapes[target])
    transform = row.transform
    if transform == "vocab":
        tensor = _vllm_vocab_rows(tensor, spec.vocab_size, shape[0], gen_tp_rank, exchange_vocab)
    elif transform == "qkv":
        tensor = megatron_qkv_to_vllm(tensor, num_heads=spec.num_heads // gen_tp,
                                      num_kv_heads=max(1, spec.num_kv_heads // gen_tp), head_dim=spec.head_dim)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"generation shard {megatron_name!r} has shape {tuple(tensor.shape)} but vLLM's "
                         f"{target!r} expects {shape} on this rank")
    return target, tensor


class ExpertStacks:
    """Per-expert generation tensors -> vLLM's fused-MoE parameters (one ``[experts, ...]``
    tensor per layer and projection), each handed out once all of its experts arrived.

    Args:
        vllm_shapes: vLLM name -> this rank's shape; a fused expert parameter's first
            dimension is the layer's expert count on the engine (all experts: megaflow's
            engines run without vLLM's expert parallelism).
    """

    def __init__(self, vllm_shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = vllm_shapes
        self._open: dict[str, tuple[torch.Tensor, set[int]]] = {}

    def add(self, target: str, expert: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Place ``expert``'s slice; return the fused tensor when it is complete, else None.

        Raises:
            ValueError: an expert index outside the parameter, or one given twice.
        """
        shape = tuple(self.shapes[target])
        opened = self._open.pop(target, None)
        stack, filled = opened if opened is not None else (tensor.new_empty(shape), set[int]())
        if not 0 <= expert < shape[0] or expert in filled:
            raise ValueError(f"expert {expert} of {target!r} is {'given twice' if expert in filled else 'out of range'}"
                             f" (the engine holds {shape[0]} experts per layer)")
        stack[expert].copy_(tensor)
        filled.add(expert)
        if len(filled) == shape[0]:
            return stack
        self._open[target] = (stack, filled)
        return None

    def check_complete(self) -> None:
        """Raise ValueError naming the fused parameters some of whose experts never arrived."""
        if self._open:
            missing = {name: sorted(set(range(stack.shape[0])) - filled)
                       for name, (stack, filled) in self._open.items()}
            raise ValueError(f"experts missing from the weight sync: {missing}")


def iter_vllm_buckets(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, *, gen_tp: int,
                      gen_tp_rank: int, vllm_shapes: Mapping[str, tuple[int, ...]],
                      exchange_vocab: Callable[[torch.Tensor, int], torch.Tensor],
                      bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream this rank's generation shard as buckets of vLLM-layout tensors.

    Args:
        named: ``(global megatron name, TP = gen_tp shard)`` pairs, consumed lazily; a
            shard may be a :class:`~megaflow.hybrid_engine.reshard.PendingTensor` (the
            resharder's :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.stream_generation_tensors`),
            fetched after the previous bucket is handed out.
        spec, gen_tp, gen_tp_rank, vllm_shapes, exchange_vocab: as in :func:`to_vllm_shard`.
            Every rank of a generation TP group must iterate the same names in the same
            order (``exchange_vocab`` is a collective).
        bucket_bytes: the most bytes (``numel * element_size`` summed) one bucket holds;
            a single larger tensor forms a bucket of its own.

    Yields:
        Lists of ``(vLLM parameter name, tensor in the engine's local shard layout)``, in
        the order of ``named``, tied output layer left out. A bucket is built only when the
        consumer asks for it; drop it after loading so that at most one is alive. Experts
        are joined into vLLM's fused parameters (:class:`ExpertStacks`), each placed in a
        bucket when its last expert arrived (the open fused tensors of a layer are the extra
        memory of an MoE sync: :func:`~megaflow.topology.weight_sync.largest_generation_tensor_bytes`).

    Raises:
        ValueError: ``bucket_bytes <= 0``, or a shard of the wrong shape (see
            :func:`to_vllm_shard`).
        KeyError: an unmapped name.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"iter_vllm_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    stacks = ExpertStacks(vllm_shapes)
    for name, tensor in named:
        target = vllm_param_name(name, spec)
        if target is None:
            continue  # a pending tensor left unfetched: no rank of its groups fetches it
        row = find_mapping(name, spec)[0]
        if row.per_expert:
            if isinstance(tensor, PendingTensor):
                tensor = tensor.fetch()
            converted = to_vllm_shard(name, tensor, spec, gen_tp=gen_tp, gen_tp_rank=gen_tp_rank,
                                      vllm_shapes=vllm_shapes, exchange_vocab=exchange_vocab)
            expert = local_expert(name, row)
            assert converted is not None and expert is not None  # (a per-expert row names its expert)
            fused = stacks.add(target, expert, converted[1])
            del tensor, converted
            if fused is None:
                continue
            nbytes = fused.numel() * fused.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((target, fused))
            size += nbytes
            del fused
            continue
        # the converted size is known before converting: hand out the full bucket first
        nbytes = math.prod(vllm_shapes.get(target, tensor.shape)) * tensor.dtype.itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        if isinstance(tensor, PendingTensor):
            tensor = tensor.fetch()  # gathered only now, with the previous bucket handed out
        converted = to_vllm_shard(name, tensor, spec, gen_tp=gen_tp, gen_tp_rank=gen_tp_rank,
                                  vllm_shapes=vllm_shapes, exchange_vocab=exchange_vocab)
        del tensor
        assert converted is not None  # only a tied output layer converts to None; vllm_param_name skipped it
        bucket.append(converted)
        size += nbytes
        del converted
    stacks.check_complete()
    if bucket:
        yield bucket


def generation_buckets(resharder, spec: ModelSpec, *, gen_tp_rank: int, vllm_shapes: Mapping[str, tuple[int, ...]],
                       bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The streamed weight sync's buckets: nothing is gathered until the first is asked for.

    Each generation tensor is gathered when needed
    (:meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.stream_generation_tensors`),
    converted (:func:`to_vllm_shard`, vocabulary rows by :func:`exchange_vocab_rows` over
    the resharder's generation TP group) and bucketed (:func:`iter_vllm_buckets`). Wake the
    engine's weights before pulling the first bucket
    (:func:`~megaflow.hybrid_engine.transport.load_buckets` does) and drop each bucket after
    loading it; afterwards ``resharder.last_stats`` describes the reshard. Collective over
    the actor's world: every rank iterates to the end.

    Args:
        resharder: a :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`.
        spec, gen_tp_rank, vllm_shapes, bucket_bytes: as in :func:`iter_vllm_buckets`.
    """
    group = resharder.groups.gen_tp

    def exchange(shard: torch.Tensor, vllm_rows: int) -> torch.Tensor:
        return exchange_vocab_rows(shard, vllm_rows, spec.vocab_size, group)

    return iter_vllm_buckets(resharder.stream_generation_tensors(), spec, gen_tp=resharder.layout.gen_tp,
                             gen_tp_rank=gen_tp_rank, vllm_shapes=vllm_shapes, exchange_vocab=exchange,
                             bucket_bytes=bucket_bytes)


__all__ = ["VLLM_PACKED_MODULES", "VLLM_FUSED_EXPERTS", "ExpertStacks",
           "vllm_param_name", "to_vllm_shard", "iter_vllm_buckets", "gather_rows",
           "vocab_row_transfers", "exchange_vocab_rows", "generation_buckets"]
