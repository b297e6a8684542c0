"""MegatronEngine: forward and training passes through megatron-core's pipeline schedules.

All model passes go through ``get_forward_backward_func`` in micro-batches using Megatron's
``forward_step(data_iterator, model) -> (output, loss_func)`` contract. The engine owns the
plumbing (left alignment, micro-batches, heads -> log-probs/values, DDP, optimizer, LR schedule,
offload); the RL loss is a callback (:data:`LossFn`) so PPO math never lives here.

Loss scaling. Megatron divides each micro-batch loss by the number of micro-batches and
Megatron DDP averages gradients over DP. Loss callbacks return *shares of the mini-batch
loss* computed with global denominators (``megaflow.algorithms.aggregate_loss``), whose sum
over micro-batches and DP ranks is the mini-batch loss, so the engine multiplies each share
by ``num_microbatches * dp_size`` before handing it to Megatron: the resulting gradient is
exactly the gradient of the mini-batch loss, independent of the split.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megaflow.config.schema import ActorConfig, CriticConfig, RefConfig
from megaflow.megatron import cpu_compat
from megaflow.megatron.batch import (
    OLD_ROUTED_EXPERTS_KEY,
    ROUTED_EXPERTS_KEY,
    LeftAlignedBatch,
    left_align_batch,
    token_budget_groups,
    unalign_positions,
)
from megaflow.megatron.denominators import GlobalDenominators
from megaflow.megatron.logprobs import chunked_vocab_parallel_log_probs, vocab_parallel_log_probs
from megaflow.megatron.parallel import ParallelInfo
from megaflow.megatron.router_aux_loss import RouterAuxLoss
from megaflow.megatron.routing_replay import RoutingReplay
from megaflow.topology.role_spec import RoleSpec

if TYPE_CHECKING:  # megatron-core has no type information: these read as Any
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

#: ``loss_fn(outputs, micro_batch, denominators) -> (loss share, metric shares)``.
#: ``outputs``: ``log_probs`` (and ``entropy`` when requested) ``[mb, R]`` for an actor, or
#: ``values`` ``[mb, R]`` for a critic; ``micro_batch``: the batch's other fields for these rows.
LossFn = Callable[[dict, dict, GlobalDenominators], tuple[torch.Tensor, dict]]

#: The loss mask: zeroed on the padding rows of a micro-batch, counted by the global denominators.
LOSS_MASK_KEY = "response_mask"
#: The LR at the start of the warm-up (``<role>.optim.lr_warmup_steps`` ramps linearly from it to ``lr``).
LR_WARMUP_INIT = 0.0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _output_layer_returns_hidden(model: GPTModel) -> None:
    """Make ``model.output_layer`` return its input (hidden states in the TP region) instead
    of logits, so the engine projects onto the vocabulary in chunks
    (:func:`~megaflow.megatron.logprobs.chunked_vocab_parallel_log_probs`).

    The input goes through the region mapping the ColumnParallelLinear would apply: with
    sequence parallelism an all-gather of the sequence (reduce-scatter of its gradient),
    otherwise an identity whose gradient is all-reduced over the TP group.
    """
    from megatron.core import tensor_parallel

    layer = model.output_layer
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False))

    def hidden_in_tp_region(input_, weight=None, runtime_gather_output=None):
        if sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True)
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(input_)
        # GPTModel transposes the output to [b, s, h], so the gradient arrives non-contiguous;
        # megatron-core's region backward all-reduces ``grad.contiguous()`` (a copy) and
        # returns the un-reduced original in that case: hand it a contiguous gradient.
        return _ContiguousGrad.apply(hidden), None

    layer.forward = hidden_in_tp_region


def _router_aux_loss(model: torch.nn.Module, spec: RoleSpec) -> RouterAuxLoss | None:
    """The auxiliary router losses of the actor with ``actor.moe_aux_loss_coeff`` or
    ``moe_z_loss_coeff`` above 0 (:mod:`megaflow.megatron.router_aux_loss`); None otherwise."""
    aux, z = (float(getattr(spec.trained_section, key, 0.0)) for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"))
    return RouterAuxLoss(model, aux_coeff=aux, z_coeff=z) if aux or z else None


def replayable_routing(routed: torch.Tensor) -> torch.Tensor:
    """``routed`` ``[..., topk]`` with every entry that has no routing (negative:
    :data:`megaflow.rollout.routing.NO_ROUTING`, the last token of each sequence, which the
    engine samples but never feeds through the model) replaced by the distinct ids
    ``0 .. topk - 1`` of its slot, so the replay gets valid expert ids. Such a position's
    output scores no response token (position ``s`` scores the token at ``s + 1``), so the
    choice does not change any log-prob."""
    slots = torch.arange(routed.shape[-1], dtype=routed.dtype, device=routed.device).expand_as(routed)
    return torch.where(routed < 0, slots, routed)


def _routing_replay(model: torch.nn.Module, spec: RoleSpec) -> tuple[RoutingReplay, list[int]] | None:
    """The :class:`RoutingReplay` of a mixture-of-experts actor (built with
    ``moe_enable_routing_replay``, :attr:`RoleSpec.model_overrides`: replay with
    ``actor.router_replay`` R2 or R3, recording for the routing-agreement metric under every
    setting) and the global (1-based) layer number of each of its MoE layers on this stage;
    None otherwise."""
    if spec.role != "actor" or not getattr(model.config, "moe_enable_routing_replay", False):
        return None
    layers: list[int] = [getattr(m, "layer_number") for m in model.modules()  # noqa: B009 (an int on megatron layers)
                         if getattr(m, "router_replay", None) is not None]
    return RoutingReplay(model), layers


class MegatronEngine:
    """Runs one role's GPTModel shard: forward-only heads and optimizer steps.

    What it reads from the role's config: the micro-batch sizes and token budgets
    (:attr:`RoleSpec.micro_batches`), ``<role>.logits_chunk_tokens`` (actor and ref), and for
    the trained roles (actor, critic) ``<role>.optim``, ``<role>.use_distributed_optimizer``,
    ``<role>.lora`` (adapters, :mod:`megaflow.megatron.lora`) and the LR decay horizon
    (:attr:`RoleSpec.lr_decay_steps`).

    Args:
        model: this rank's ``GPTModel`` from :func:`megaflow.megatron.model.build_gpt_model`.
        info: this rank's :class:`~megaflow.megatron.parallel.ParallelInfo`.
        spec: the role (:class:`~megaflow.topology.role_spec.RoleSpec`); its head gives the
            outputs (actor, ref: log-probs/entropy; critic: values; reward model: scores),
            and the trained roles get Megatron DDP, the optimizer and the LR schedule.
        vocab_size: the real (unpadded) vocabulary size; padded ids get no probability.

    Raises:
        NotImplementedError: context parallelism (cp > 1) or virtual pipeline stages.
    """

    def __init__(self, model: GPTModel, info: ParallelInfo, spec: RoleSpec, *, vocab_size: int) -> None:
        if info.cp_size > 1 or info.vpp_size is not None:
            raise NotImplementedError("MegatronEngine supports cp=1 and no virtual pipeline")
        self.info, self.spec, self.head = info, spec, spec.head
        self.sizes = spec.micro_batches
        section = spec.section  # the LM-head roles (actor, ref) have logits_chunk_tokens
        self.logits_chunk_tokens = section.logits_chunk_tokens if isinstance(section, ActorConfig | RefConfig) else None
        self.vocab_size = vocab_size
        self.model = model
        self.optimizer: MegatronOptimizer | None = None
        self.scheduler: OptimizerParamScheduler | None = None
        self.device = next(model.parameters()).device
        self._offloaded: set[str] = set()
        self.router_aux = _router_aux_loss(model, spec)
        self.routing_replay = _routing_replay(model, spec)
        self.router_replay = spec.actor.router_replay if self.routing_replay is not None else "off"
        self._replay_key: str | None = None  # the batch field the running pass replays
        self._recorded: list[torch.Tensor] | None = None  # the running pass's routing, per micro-batch
        if self.logits_chunk_tokens is not None and info.is_last_pp_stage:
            _output_layer_returns_hidden(self.module)
        if spec.trains:
            self._apply_lora()
            self._setup_training()

    # ------------------------------------------------------------------ set-up
    def _apply_lora(self) -> None:
        """``<role>.lora.rank > 0``: adapters on the targeted linears, the base frozen (before
        DDP and the optimizer, so both cover the adapters only; a critic's value head stays trained)."""
        from megaflow.megatron.lora import LoRASettings, apply_lora

        section = self.spec.section
        if not isinstance(section, ActorConfig | CriticConfig):  # only the trained roles have a lora section
            return
        settings = LoRASettings.from_config(section.lora, self.spec.config.trainer.seed)
        if settings is None:
            return
        value_head = self.head == "value" and self.info.is_last_pp_stage
        apply_lora(self.model, settings, keep_trainable=("output_layer.weight",) if value_head else ())

    def _setup_training(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        section = self.spec.section
        assert isinstance(section, ActorConfig | CriticConfig)  # (called for the trained roles only: spec.trains)
        optim, tc = section.optim, self.model.config
        distributed = self.spec.distributed_optimizer
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=distributed, check_for_nan_in_grad=False)
        self.model = DistributedDataParallel(config=tc, ddp_config=ddp_config, module=self.model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
            clip_grad=optim.clip_grad, bf16=tc.bf16, fp16=tc.fp16, params_dtype=tc.params_dtype,
            use_distributed_optimizer=distributed), [self.model])
        decay_steps = self.spec.lr_decay_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=LR_WARMUP_INIT, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
            end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
        tc.grad_scale_func = self.optimizer.scale_loss
        tc.no_sync_func = self.model.no_sync
        tc.finalize_model_grads_func = finalize_model_grads

    @property
    def module(self) -> GPTModel:
        """The unwrapped GPTModel (parameter names as documented in megaflow.megatron.model)."""
        return getattr(self.model, "module", self.model)

    @property
    def lr(self) -> float | None:
        return None if self.optimizer is None else self.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, aligned: LeftAlignedBatch, micro_batch_size: int, max_tokens: int | None = None
                       ) -> tuple[list[LeftAlignedBatch], torch.Tensor | None]:
        """Cut ``aligned`` into micro-batches: ``micro_batch_size`` rows each (the last one
        padded with zero-loss copies), or with ``max_tokens`` groups of rows of at most that
        many padded tokens, each cut to its own width (:func:`token_budget_groups`).

        Returns:
            ``(chunks, order)``: ``order`` ``[rows]`` is the row index of the concatenated
            chunks (None for the fixed split, whose chunks keep the row order).
        """
        if max_tokens is None:
            padded, _ = aligned.pad_rows(micro_batch_size, zero_keys=(LOSS_MASK_KEY,))
            return [padded.rows(i, i + micro_batch_size) for i in range(0, padded.num_rows, micro_batch_size)], None
        multiple = self.info.tp_size if self.module.config.sequence_parallel else 1
        groups = token_budget_groups(aligned.lengths, max_tokens, width_multiple=multiple)
        if self.info.pp_size > 1:  # stages exchange activations of per-micro-batch shapes
            self.module.config.variable_seq_lengths = True
        return [aligned.select(index, width) for index, width in groups], torch.cat([i for i, _ in groups])

    def _forward_step(self, head: Callable, data_iterator, model):
        mb: LeftAlignedBatch = next(data_iterator)
        if self.router_aux is not None:  # counted rows: the global denominators' sequences
            counted = mb.fields[LOSS_MASK_KEY].ne(0).any(-1) if LOSS_MASK_KEY in mb.fields \
                else torch.ones(mb.num_rows, dtype=torch.bool)
            self.router_aux.micro_batch(mb.lengths, counted, mb.seq_len)
        ids = mb.input_ids.to(self.device, non_blocking=True)
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        with self._routing(mb):
            output = model(ids, positions, cpu_compat.attention_mask_argument(ids.shape[1], self.device))
        return output, partial(head, mb)

    def _replay_field(self, update: bool) -> str | None:
        """The batch field a pass replays: ``routed_experts`` in every pass with R3,
        ``old_routed_experts`` in the update with R2; None otherwise."""
        if self.router_replay == "R3":
            return ROUTED_EXPERTS_KEY
        return OLD_ROUTED_EXPERTS_KEY if self.router_replay == "R2" and update else None

    @contextlib.contextmanager
    def _routing(self, mb: LeftAlignedBatch):
        """The routing of one micro-batch's forward: replayed from the field :attr:`_replay_key`
        (``[b, s, moe_layers, topk]``, aligned with the tokens: each MoE layer of this stage
        gets its global layer's ``[s * b, topk]`` ids in the router's token order,
        sequence-major), and/or recorded into :attr:`_recorded` (the router's own top-k; when
        replaying, the top-k it would choose given the replayed layer inputs).

        Raises:
            ValueError: the replayed field has fewer MoE layers than the model.
        """
        if self.routing_replay is None or (self._replay_key is None and self._recorded is None):
            yield
            return
        replay, layers = self.routing_replay
        record = self._recorded is not None
        if self._replay_key is None:
            context = replay.record()
        else:
            routed = mb.fields[self._replay_key]  # present: checked by left_align on every rank
            if routed.shape[2] < max(layers):
                raise ValueError(f"{self._replay_key} has {routed.shape[2]} MoE layers, the model {max(layers)}")
            routed = replayable_routing(routed)
            targets = [routed[:, :, layer - 1].transpose(0, 1).reshape(-1, routed.shape[-1]) for layer in layers]
            context = replay.replay(targets, record_own=record)
        with context as own:
            yield
        if self._recorded is not None:
            self._recorded.append(self._stage_routing(own, layers, mb.num_rows, mb.seq_len))

    def _stage_routing(self, own: list[torch.Tensor], layers: list[int], rows: int, width: int) -> torch.Tensor:
        """This stage's recorded ``[s * b, topk]`` per MoE layer as ``[b, s, num_layers, topk]``
        in the compact dtype (global layer number - 1; 0 at the other stages' layers)."""
        from megaflow.rollout.routing import routed_experts_dtype

        topk = own[0].shape[-1]
        dtype = routed_experts_dtype(int(self.module.config.num_moe_experts))
        out = torch.zeros((rows, width, self.module.config.num_layers, topk), dtype=dtype)
        for layer, ids in zip(layers, own, strict=True):
            out[:, :, layer - 1] = ids.detach().cpu().reshape(width, rows, topk).transpose(0, 1)
        return out

    def _recorded_routing(self, aligned: LeftAlignedBatch, order: torch.Tensor | None,
                          attention_mask: torch.Tensor) -> torch.Tensor:
        """The pass's recorded routing in the batch's verl layout ``[batch, seq, num_layers,
        topk]`` (:data:`~megaflow.megatron.batch.OLD_ROUTED_EXPERTS_KEY`): micro-batches widened
        to the pass's width, back in row order, the pipeline stages' layers summed over PP (each
        stage fills only its own), -1 where a position holds no token."""
        from megaflow.rollout.routing import NO_ROUTING

        assert self._recorded is not None
        width = aligned.seq_len
        parts = [torch.nn.functional.pad(r, (0, 0, 0, 0, 0, width - r.shape[1])) for r in self._recorded]
        routing = torch.cat(parts)
        if order is not None:  # token-budget groups: back to the batch's row order
            restored = torch.empty_like(routing)
            restored[order] = routing
            routing = restored
        routing = routing[: aligned.num_rows]
        if self.info.pp_size > 1:  # summed in int32 (backends differ in their small integer types)
            summed = routing.to(self.device, torch.int32)
            dist.all_reduce(summed, group=self.info.pp_group)
            routing = summed.cpu().to(routing.dtype)
        return unalign_positions(routing, attention_mask, NO_ROUTING)

    def _head_outputs(self, mb: LeftAlignedBatch, output: torch.Tensor, sampling: Mapping[str, Any],
                      with_entropy: bool) -> dict[str, torch.Tensor]:
        """Model output on aligned positions -> per-response-token tensors ``[mb, R]``
        (``sampling``: ``temperature``, ``top_p``, ``top_k`` of the actor's log-probs)."""
        index = mb.response_index.to(self.device)
        valid = mb.response_valid.to(self.device)
        if self.head == "value":  # value of the state before response token t: head(h_{t-1})
            return {"values": output.squeeze(-1).gather(1, index).float() * valid}
        if self.head == "reward":  # score after reading token t: head(h_t)
            at_token = (index + 1).clamp_max(mb.seq_len - 1)
            return {"scores": output.squeeze(-1).gather(1, at_token).float() * valid}
        at_response = output.gather(1, index.unsqueeze(-1).expand(-1, -1, output.shape[-1]))
        labels = mb.input_ids.to(self.device).gather(1, (index + 1).clamp_max(mb.seq_len - 1))
        labels = torch.where(valid, labels, torch.zeros_like(labels))
        common = dict(tp_group=self.info.tp_group, vocab_size=self.vocab_size, with_entropy=with_entropy, **sampling)
        if self.logits_chunk_tokens is None:  # the model returned logits
            log_probs, entropy = vocab_parallel_log_probs(at_response, labels, **common)
        else:  # the model returned hidden states: project and normalise chunk by chunk
            log_probs, entropy = chunked_vocab_parallel_log_probs(
                at_response, self._output_weight(), labels,
                chunk_tokens=self.logits_chunk_tokens, **common)
        out = {"log_probs": log_probs * valid}
        if entropy is not None:
            out["entropy"] = entropy * valid
        return out

    def _output_weight(self) -> torch.Tensor:
        """This rank's ``[V/tp, h]`` output projection (the embedding's when they are tied)."""
        module = self.module
        if module.share_embeddings_and_output_weights:
            return module.shared_embedding_or_output_weight()
        return module.output_layer.weight

    def _run(self, chunks: list, forward_only: bool, head: Callable, seq_len: int,
             micro_batch_size: int) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, head),
            data_iterator=iter(chunks), model=self.model, num_microbatches=len(chunks),
            seq_length=seq_len, micro_batch_size=micro_batch_size, forward_only=forward_only)

    def left_align(self, batch: Mapping[str, torch.Tensor], *, update: bool = True) -> LeftAlignedBatch:
        """Validate and left-align ``batch`` (:func:`~megaflow.megatron.batch.left_align_batch`
        at this engine's sequence limit, vocabulary and width multiple) for an update
        (``update``) or a forward pass, which differ in the routing field they replay
        (``actor.router_replay``).

        Every rank raises if any rank's batch is invalid: the ranks agree (one all-reduce of
        a flag) before any collective of the pass, so a bad batch on one DP rank is an
        error everywhere instead of a hang.

        Raises:
            ValueError: this rank's batch is invalid (its error), or another rank's is.
        """
        error: ValueError | None = None
        try:
            field = self._replay_field(update)
            if field is not None and field not in batch:
                raise ValueError(f"actor.router_replay={self.router_replay} replays the batch field {field!r}, which "
                                 f"this batch lacks (it has {sorted(batch)})")
            aligned = left_align_batch(batch, max_seq_len=self.sizes.max_seq_len, vocab_size=self.vocab_size,
                                width_multiple=self.info.tp_size if self.module.config.sequence_parallel else 1)
        except ValueError as exc:
            error = exc
        flag = torch.tensor([0.0 if error is None else 1.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if flag.item():
            raise ValueError("another rank rejected its part of the batch (see its error)")
        return self._expert_parallel_width(aligned)

    def _expert_parallel_width(self, aligned: LeftAlignedBatch) -> LeftAlignedBatch:
        """With ep > 1, ``aligned`` widened to the longest width in its EP group: megatron-core's
        all-gather token dispatcher gathers equally many tokens from every EP rank, so the EP
        ranks' micro-batches must have equal ``[rows, width]`` (equal rows: the dispatch gives
        every DP rank as many rows, and token-budget micro-batches are refused with ep > 1 at
        load). Unchanged at ep = 1."""
        if self.info.ep_size == 1:
            return aligned
        width = torch.tensor([aligned.seq_len], dtype=torch.int64, device=self.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=self.info.ep_group)
        return aligned.widen(int(width.item()))

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Mapping[str, torch.Tensor], *, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = -1, with_entropy: bool = False, micro_batch_size: int | None = None,
                record_routing: bool = False) -> dict[str, torch.Tensor] | None:
        """Forward-only per-response-token outputs, in micro-batches.

        Args:
            batch: verl-layout tensors (:mod:`megaflow.megatron.batch`): ``input_ids``,
                ``attention_mask``, ``responses`` ``[batch, ...]`` (+ ``position_ids``).
            temperature: the rollout's sampling temperature (log-probs of
                ``softmax(logits / temperature)``); actor only.
            top_p, top_k: the rollout's nucleus mass (1 = off) and top-k (``<= 0`` = off):
                log-probs and entropy of the truncated, renormalised distribution
                (:func:`~megaflow.megatron.logprobs.truncation_mask`); actor only.
            with_entropy: also return ``entropy``; actor only.
            micro_batch_size: rows per micro-batch; None: the role's forward micro-batch size,
                or its token budget with ``use_dynamic_bsz``.
            record_routing: the old-log-prob forward of a mixture-of-experts actor: record the
                router's own top-k experts when ``actor.router_replay`` is R2 (the update
                replays them) or the batch has the engine's ``routed_experts`` (the
                routing-agreement metric, under every ``actor.router_replay``; R3 records the
                choice each router would make at the replayed layer inputs). Ignored otherwise.

        Returns:
            On the last pipeline stage, a dict of float32 CPU tensors ``[batch, R]``:
            ``log_probs`` (+ ``entropy``) for an actor; ``values`` for a critic (head of the
            hidden state before each response token, aligned like log-probs); ``scores`` for
            a reward model (head of the hidden state at each response token; the sequence
            score is the entry of the last real token). Zero on response padding. With a
            recording (``record_routing``) also ``old_routed_experts`` ``[batch, seq,
            num_layers, topk]`` (:data:`~megaflow.megatron.batch.OLD_ROUTED_EXPERTS_KEY`, the
            compact dtype of :func:`~megaflow.rollout.routing.routed_experts_dtype`). None on
            other stages.

        Raises:
            ValueError: invalid batch (see :func:`megaflow.megatron.batch.left_align_batch`),
                e.g. a sequence longer than ``data.max_prompt_length + rollout.response_length``.
        """
        self._require_loaded("params")
        mbs = micro_batch_size or self.sizes.forward_micro_batch_size
        aligned = self.left_align(batch, update=False)
        budget = None if micro_batch_size else self.sizes.forward_max_tokens
        chunks, order = self._micro_batches(aligned, mbs, budget)
        head = partial(self._forward_head, dict(temperature=temperature, top_p=top_p, top_k=top_k), with_entropy)
        self.model.eval()
        record = record_routing and self.routing_replay is not None and (
            self.router_replay == "R2" or ROUTED_EXPERTS_KEY in batch)
        with self._pass_routing(self._replay_field(update=False), record):
            store = self._run(chunks, True, head, aligned.seq_len, mbs)
            routing = self._recorded_routing(aligned, order, batch["attention_mask"]) if record else None
        if not self.info.is_last_pp_stage:
            return None
        outputs = {k: torch.cat([d[k] for d in store]) for k in store[0]}
        if order is not None:  # token-budget groups: back to the batch's row order
            restored = {k: torch.empty_like(v) for k, v in outputs.items()}
            for k, v in outputs.items():
                restored[k][order.to(v.device)] = v
            outputs = restored
        outputs = {k: v[: aligned.num_rows].cpu() for k, v in outputs.items()}
        return outputs if routing is None else {**outputs, OLD_ROUTED_EXPERTS_KEY: routing}

    @contextlib.contextmanager
    def _pass_routing(self, replay_key: str | None, record: bool):
        """For one pass: replay the batch field ``replay_key`` (None: the router decides) and,
        with ``record``, collect each micro-batch's routing in :attr:`_recorded`."""
        self._replay_key, self._recorded = replay_key, [] if record else None
        try:
            yield
        finally:
            self._replay_key, self._recorded = None, None

    def _forward_head(self, sampling, with_entropy, mb, output):
        outputs = self._head_outputs(mb, output, sampling, with_entropy)
        return torch.zeros((), device=self.device), outputs

    # ------------------------------------------------------------------ training
    def global_denominators(self, batch: Mapping[str, torch.Tensor]) -> GlobalDenominators:
        """Valid tokens and sequences (>= 1 valid token) of the mini-batch over all DP ranks.

        Counted on ``batch[LOSS_MASK_KEY]`` ``[batch, R]``, all-reduced over DP.
        """
        key = LOSS_MASK_KEY
        if key not in batch:
            raise ValueError(f"batch has no loss mask {key!r}; it has {sorted(batch)}")
        valid = batch[key] != 0
        counts = torch.tensor([float(valid.sum()), float(valid.any(dim=-1).sum())],
                              dtype=torch.float64, device=self.device)
        if self.info.dp_size > 1:
            dist.all_reduce(counts, group=self.info.dp_group)
        return GlobalDenominators(num_tokens=int(counts[0]), num_seqs=int(counts[1]))

    def train_step(self, batch: Mapping[str, torch.Tensor] | LeftAlignedBatch, loss_fn: LossFn, *,
                   temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                   with_entropy: bool = False, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimizer step on this rank's part of a mini-batch (gradient accumulation).

        Args:
            batch: verl-layout tensors plus the loss inputs (``response_mask``,
                ``old_log_probs``, ``advantages``, ``returns``...) ``[batch, ...]``, or
                those rows already aligned (:meth:`left_align`, then
                :meth:`~megaflow.megatron.batch.LeftAlignedBatch.take` per mini-batch).
            loss_fn: :data:`LossFn`; returns this micro-batch's share of the mini-batch loss
                (global denominators) and additive metric shares (summed over micro-batches
                and DP ranks to give the mini-batch value).
            temperature, top_p, top_k, with_entropy: as in :meth:`forward` (actor).
            micro_batch_size: rows per micro-batch; None: the role's update micro-batch size,
                or its token budget with ``use_dynamic_bsz``.

        Returns:
            Metrics: the summed loss (``loss``) and the callback's metrics on the last
            pipeline stage, and on every rank ``grad_norm``, ``lr`` and ``update_successful``.

        Raises:
            RuntimeError: the role does not train (ref, reward model) or the engine is offloaded.
            ValueError: invalid batch.
        """
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError(f"train_step: role {self.spec.role!r} has no optimizer (only actor and critic train)")
        self._require_loaded("params", "grads", "optimizer")
        mbs = micro_batch_size or self.sizes.update_micro_batch_size
        assert mbs is not None  # (a role with an optimizer has an update micro-batch size)
        aligned = self._expert_parallel_width(batch) if isinstance(batch, LeftAlignedBatch) else self.left_align(batch)
        denominators = self.global_denominators(aligned.fields)
        budget = None if micro_batch_size else self.sizes.update_max_tokens
        chunks, _ = self._micro_batches(aligned, mbs, budget)
        scale = len(chunks) * self.info.dp_size
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        head = partial(self._loss_head, loss_fn, denominators, scale, sampling, with_entropy)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.scheduler.step(1)  # the k-th update uses the LR of step k (warm-up starts > 0)
        with self._router_aux_step(denominators), self._pass_routing(self._replay_field(update=True), False):
            store = self._run(chunks, False, head, aligned.seq_len, mbs)
        update_successful, grad_norm, _ = self.optimizer.step()
        metrics = self._reduce_metrics(store)
        if self.router_aux is not None:  # every rank: all-reduced over DP, then PP (each stage's layers)
            metrics.update(self.router_aux.totals((self.info.dp_group, self.info.pp_group)))
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                       lr=self.optimizer.param_groups[0]["lr"], update_successful=float(bool(update_successful)))
        return metrics

    def _router_aux_step(self, denominators: GlobalDenominators):
        """The auxiliary router losses' context of one update (a null context without them):
        normalised by the mini-batch's sequences, their gradient scaled like a loss share's
        (``dp_size`` x the optimizer's loss scale; Megatron DDP then averages over DP)."""
        if self.router_aux is None:
            return contextlib.nullcontext()
        loss_scale = float(self.module.config.grad_scale_func(torch.ones(1, device=self.device)))
        return self.router_aux.step(denominators.num_seqs, self.info.dp_size * loss_scale)

    def _loss_head(self, loss_fn, denominators, scale, sampling, with_entropy, mb, output):
        outputs = self._head_outputs(mb, output, sampling, with_entropy)
        fields = {k: v.to(self.device, non_blocking=True) for k, v in mb.fields.items()}
        loss, metrics = loss_fn(outputs, fields, denominators)
        shares = {k: torch.as_tensor(v, dtype=torch.float64).detach().reshape(())
                  for k, v in metrics.items()}
        shares["loss"] = loss.detach().double()
        return loss * scale, shares

    def _reduce_metrics(self, store: list) -> dict[str, float]:
        if not self.info.is_last_pp_stage or not store:
            return {}
        keys = sorted(store[0])
        totals = torch.stack([sum(d[k].cpu() for d in store) for k in keys]).to(self.device)
        if self.info.dp_size > 1:
            dist.all_reduce(totals, group=self.info.dp_group)
        return {k: float(v) for k, v in zip(keys, totals.tolist(), strict=True)}

    # ------------------------------------------------------------------ offload
    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move parameters, gradient buffers and optimizer state to host memory between phases.

        A no-op for tensors already in host memory (CPU runs walk the same path). Use
        :meth:`reload` before the next forward/train step.
        """
        from megaflow.megatron import offload as off

        if params and "params" not in self._offloaded:
            off.offload_params(self.model)
            self._offloaded.add("params")
        if grads and self.optimizer is not None and "grads" not in self._offloaded:
            off.offload_grads(self.model)
            self._offloaded.add("grads")
        if optimizer and self.optimizer is not None and "optimizer" not in self._offloaded:
            off.offload_optimizer(self.optimizer)
            self._offloaded.add("optimizer")

    def reload(self, parts: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Bring ``parts`` (of what :meth:`offload` moved) back to the accelerator; a forward
        pass or a weight sync needs ``("params",)`` only.

        Raises:
            ValueError: an unknown part name.
        """
        from megaflow.megatron import offload as off

        unknown = set(parts) - {"params", "grads", "optimizer"}
        if unknown:
            raise ValueError(f"unknown engine state {sorted(unknown)}; parts are params, grads, optimizer")
        if "params" in parts and "params" in self._offloaded:
            off.reload_params(self.model)
        if "grads" in parts and "grads" in self._offloaded:
            off.reload_grads(self.model)
        if "optimizer" in parts and "optimizer" in self._offloaded:
            off.reload_optimizer(self.optimizer)
        self._offloaded.difference_update(parts)

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._offloaded)

    def _require_loaded(self, *parts: str) -> None:
        missing = sorted(self._offloaded.intersection(parts))
        if missing:
            raise RuntimeError(f"engine state {missing} is offloaded; call reload() first")


__all__ = ["MegatronEngine", "GlobalDenominators", "LossFn", "LOSS_MASK_KEY"]
