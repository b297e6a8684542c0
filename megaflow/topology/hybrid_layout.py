"""Layout planning for the 3D-HybridEngine: pure functions, plain frozen data, no processes.

The actor trains in layout p-t-d (pipeline, tensor, data parallel sizes) and generates in
layout p_g-t_g-d_g-d, where ``d_g = (p*t) / (p_g*t_g)`` is the micro data-parallel size:
every training replica becomes ``d_g`` generation replicas (HybridFlow, Sheng et al. 2024,
section 5 and Table 2).

Rank order. Global ranks follow megatron-core 0.16.1's default order ``"tp-cp-ep-dp-pp"``
with cp = ep = 1, i.e. ``rank = tp_rank + t * (dp_rank + d * pp_rank)``: a *training TP
block* is ``t`` consecutive ranks.

Generation layout (derived, never chosen freely, because it is what lets a rank's training
shard sit inside its generation shard with zero redundancy). With ``m = t / t_g`` and
``k = p / p_g``:

* ``gen_tp_rank = tp_rank // m`` and ``micro_tp = tp_rank % m``: the generation TP group is
  the ranks at stride ``m`` inside a training TP block; the ranks ``j*m .. j*m+m-1`` of the
  block (consecutive) all hold generation shard ``j``, which is the concatenation of their
  training shards;
* ``gen_pp_rank = pp_rank // k`` and ``micro_pp = pp_rank % k``: a generation stage folds
  ``k`` consecutive training stages;
* micro-DP group: the ``d_g = m*k`` ranks of one training replica with the same
  ``(gen_tp_rank, gen_pp_rank)``, ordered by global rank; ``micro_dp_rank = micro_pp*m +
  micro_tp``. Execution splits it into a *gather group* (the ``m`` consecutive ranks of one
  stage, all-gather along the partition dim) and a *fold group* (the ``k`` ranks with the
  same ``tp_rank`` across the folded stages, broadcast of each stage's buffers);
* generation replica (the generation mesh's dp rank): ``dp_rank * d_g + micro_dp_rank``;
  ``is_collect`` on the generation mesh: ``gen_tp_rank == 0 and gen_pp_rank == p_g - 1``
  (:func:`megaflow.single_controller.decorator.nd_compute`; the pp condition only matters
  when p_g > 1).

vLLM. vLLM builds its TP groups from *consecutive* ranks (layout ExternalDP x DP x PP x TP,
TP fastest), whereas the generation TP groups above are strided. The training side cannot
adapt: megatron's TP block must be consecutive and rank ``tp_rank`` must hold generation
shard ``tp_rank // m`` for the alias. So **the rollout side adapts**: it builds vLLM's
groups from :attr:`HybridLayout.vllm_rank_order` (vLLM rank -> global rank) instead of
``arange(world_size)``; equivalently each generation TP group is
:attr:`HybridLayout.gen_tp_groups` ``[i]`` (global ranks in generation TP rank order).
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

__all__ = [
    "RankPlacement",
    "HybridLayout",
    "plan_hybrid_layout",
    "ReshardCost",
    "reshard_cost",
    "expert_sync_bytes_received",
]


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """Where one global rank sits in the training and in the generation layout."""

    rank: int
    tp_rank: int          # training TP rank
    pp_rank: int          # training PP stage
    dp_rank: int          # training DP rank (training replica)
    gen_tp_rank: int      # TP rank inside the generation replica (= tp_rank // m)
    gen_pp_rank: int      # PP stage inside the generation replica (= pp_rank // k)
    gen_dp_rank: int      # generation replica index (dp rank of the generation mesh)
    micro_dp_rank: int    # position inside the micro-DP group (= micro_pp * m + micro_tp)
    is_collect: bool      # collect flag on the generation mesh
    vllm_rank: int        # rank vLLM must see for its consecutive TP groups to match
    ep_rank: int = 0      # expert-parallel rank (= dp_rank % ep): owner of experts ep_rank*E/ep ..


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Training layout p-t-d, generation layout p_g-t_g-d_g-d, and all their rank groups.

    Every ``*_groups`` field is a tuple of groups, each a tuple of global ranks (in the
    order the group's collective uses); together the groups of one kind partition the
    world. ``ranks[r]`` is the :class:`RankPlacement` of global rank ``r``.
    """

    tp: int
    pp: int
    dp: int
    gen_tp: int
    gen_pp: int
    ranks: tuple[RankPlacement, ...]
    train_tp_groups: tuple[tuple[int, ...], ...]
    train_pp_groups: tuple[tuple[int, ...], ...]
    gen_tp_groups: tuple[tuple[int, ...], ...]    # index = gen replica * gen_pp + gen pp stage
    gen_pp_groups: tuple[tuple[int, ...], ...]
    micro_dp_groups: tuple[tuple[int, ...], ...]  # size d_g, ordered by micro_dp_rank
    gather_groups: tuple[tuple[int, ...], ...]    # size m: all-gather along the partition dim
    fold_groups: tuple[tuple[int, ...], ...]      # size k: broadcast of folded stages
    vllm_rank_order: tuple[int, ...]              # vLLM rank -> global rank
    ep: int = 1                                   # expert-parallel size (divides dp)
    ep_groups: tuple[tuple[int, ...], ...] = ()   # size ep: broadcast of each rank's experts

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tp_ratio(self) -> int:
        """``m = t / t_g``: training TP shards per generation TP shard."""
        return self.tp // self.gen_tp

    @property
    def pp_ratio(self) -> int:
        """``k = p / p_g``: training stages per generation stage."""
        return self.pp // self.gen_pp

    @property
    def micro_dp(self) -> int:
        """``d_g = (p*t) / (p_g*t_g)``: generation replicas per training replica."""
        return self.tp_ratio * self.pp_ratio

    @property
    def gen_dp(self) -> int:
        """Number of generation replicas, ``d * d_g``."""
        return self.dp * self.micro_dp

    def rank_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        """Global rank of a training coordinate (megatron order tp-cp-ep-dp-pp)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def training_stages_of(self, gen_pp_rank: int) -> range:
        """Training stages folded into generation stage ``gen_pp_rank``."""
        return range(gen_pp_rank * self.pp_ratio, (gen_pp_rank + 1) * self.pp_ratio)


def _check_positive(**sizes: int) -> None:
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key} must be an int, got {type(value).__name__} ({value!r})")
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


def _validate(tp: int, pp: int, dp: int, gen_tp: int, gen_pp: int,
              num_attention_heads: int | None, num_query_groups: int | None, ep: int = 1) -> None:
    _check_positive(tp=tp, pp=pp, dp=dp, gen_tp=gen_tp, gen_pp=gen_pp, ep=ep)
    if dp % ep:
        raise ValueError(f"expert parallel ep={ep} must divide the data parallel size dp={dp} "
                         "(megatron-core carves the expert groups out of the data-parallel ranks)")
    if tp % gen_tp:
        raise ValueError(f"generation tp={gen_tp} must divide training tp={tp} (t % t_g == 0)")
    if pp % gen_pp:
        raise ValueError(f"generation pp={gen_pp} must divide training pp={pp} (p % p_g == 0)")
    for key, heads in (("num_attention_heads", num_attention_heads),
                       ("num_query_groups", num_query_groups)):
        if heads is None:
            continue
        _check_positive(**{key: heads})
        if heads % gen_tp:
            raise ValueError(f"{key}={heads} is not divisible by generation tp={gen_tp}")
        if heads % tp:
            # megatron-core 0.16.1 shards whole KV groups (attention.py: divide(groups, tp)),
            # so tp > num_query_groups (KV-head replication) is not a trainable layout.
            raise ValueError(f"{key}={heads} is not divisible by training tp={tp}: "
                             "megatron-core requires whole heads and KV groups per TP rank")


def plan_hybrid_layout(tp: int, pp: int, dp: int, gen_tp: int, gen_pp: int = 1, *,
                       num_attention_heads: int | None = None,
                       num_query_groups: int | None = None, ep: int = 1) -> HybridLayout:
    """Plan the generation layout and every rank group of the 3D-HybridEngine.

    Args:
        tp, pp, dp: training tensor, pipeline and data parallel sizes (t, p, d); the
            world is ``tp*pp*dp`` ranks in megatron-core order tp-cp-ep-dp-pp.
        gen_tp, gen_pp: generation tensor and pipeline sizes (t_g, p_g).
        num_attention_heads, num_query_groups: the model's query heads and KV heads; when
            given, both must be divisible by ``tp`` (megatron) and by ``gen_tp``.
        ep: expert-parallel size of a mixture-of-experts actor (megatron-core's expert grid
            with expert TP = ``tp``: ``ep_rank = dp_rank % ep``); the ``ep`` ranks with the
            same ``(tp_rank, pp_rank, dp_rank // ep)`` hold disjoint expert slices and form an
            ``ep_groups`` entry (ordered by ``ep_rank``). The generation layout is unchanged:
            every generation replica holds all experts (vLLM without expert parallelism).

    Returns:
        The :class:`HybridLayout` (see the module docstring for the rank maps).

    Raises:
        TypeError: a size is not an int.
        ValueError: a size < 1, ``tp % gen_tp``, ``pp % gen_pp``, ``dp % ep``, or heads / KV
            heads not divisible by ``tp`` or ``gen_tp``; the message names the offending value.
    """
    _validate(tp, pp, dp, gen_tp, gen_pp, num_attention_heads, num_query_groups, ep)
    m, k = tp // gen_tp, pp // gen_pp
    d_g = m * k
    placements = []
    for rank in range(tp * pp * dp):
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        gen_tp_rank, gen_pp_rank = tp_rank // m, pp_rank // k
        micro_dp_rank = (pp_rank % k) * m + tp_rank % m
        gen_dp_rank = dp_rank * d_g + micro_dp_rank
        placements.append(RankPlacement(
            rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
            gen_tp_rank=gen_tp_rank, gen_pp_rank=gen_pp_rank, gen_dp_rank=gen_dp_rank,
            micro_dp_rank=micro_dp_rank,
            is_collect=gen_tp_rank == 0 and gen_pp_rank == gen_pp - 1,
            vllm_rank=(gen_dp_rank * gen_pp + gen_pp_rank) * gen_tp + gen_tp_rank, ep_rank=dp_rank % ep))

    def groups(key, order) -> tuple[tuple[int, ...], ...]:
        """Group ranks by ``key(placement)``, each group sorted by ``order(placement)``."""
        buckets: dict = {}
        for pl in placements:
            buckets.setdefault(key(pl), []).append(pl)
        return tuple(tuple(pl.rank for pl in sorted(members, key=order))
                     for _, members in sorted(buckets.items()))

    by_rank = lambda pl: pl.rank  # noqa: E731
    vllm_order = sorted(placements, key=lambda pl: pl.vllm_rank)
    return HybridLayout(
        tp=tp, pp=pp, dp=dp, gen_tp=gen_tp, gen_pp=gen_pp, ranks=tuple(placements),
        train_tp_groups=groups(lambda pl: (pl.pp_rank, pl.dp_rank), by_rank),
        train_pp_groups=groups(lambda pl: (pl.dp_rank, pl.tp_rank), by_rank),
        gen_tp_groups=groups(lambda pl: (pl.gen_dp_rank, pl.gen_pp_rank),
                             lambda pl: pl.gen_tp_rank),
        gen_pp_groups=groups(lambda pl: (pl.gen_dp_rank, pl.gen_tp_rank),
                             lambda pl: pl.gen_pp_rank),
        micro_dp_groups=groups(lambda pl: (pl.dp_rank, pl.gen_pp_rank, pl.gen_tp_rank),
                               lambda pl: pl.micro_dp_rank),
        gather_groups=groups(lambda pl: (pl.pp_rank, pl.dp_rank, pl.gen_tp_rank), by_rank),
        fold_groups=groups(lambda pl: (pl.gen_pp_rank, pl.dp_rank, pl.tp_rank), by_rank),
        vllm_rank_order=tuple(pl.rank for pl in vllm_order),
        ep=ep,
        ep_groups=groups(lambda pl: (pl.pp_rank, pl.tp_rank, pl.dp_rank // ep), lambda pl: pl.ep_rank),
    )


# ---------------------------------------------------------------------------------------
# Cost model


@dataclasses.dataclass(frozen=True)
class ReshardCost:
    """Per-rank cost of the train -> generate transition (HybridFlow Table 2).

    All values in bytes. ``micro_dp_*``: the micro-DP all-gather of the 3D-HybridEngine,
    communication ``(t*p - t_g*p_g) / (t_g*p_g*t*p) * M`` received per rank and peak
    weight memory ``M / (t_g*p_g)``. ``naive_*``: gather the full model on every rank and
    keep a slice, ``(t*p - 1) / (t*p) * M`` and peak ``M``. ``training_bytes`` is the
    training shard ``M / (t*p)``, already on the rank.
    """

    model_bytes: int
    training_bytes: float
    micro_dp_bytes: float
    micro_dp_peak_bytes: float
    naive_bytes: float
    naive_peak_bytes: float

    @property
    def communication_ratio(self) -> float:
        """naive / micro-DP bytes per rank (inf when micro-DP moves nothing)."""
        return self.naive_bytes / self.micro_dp_bytes if self.micro_dp_bytes else float("inf")


def reshard_cost(layout: HybridLayout, model_bytes: int) -> ReshardCost:
    """Closed-form per-rank costs of the reshard (HybridFlow section 5) for a model of ``model_bytes``.

    Exact when every parameter is TP-partitioned and the stages are equal; replicated
    parameters (norms) and uneven stages make the real figures differ slightly
    (:class:`megaflow.hybrid_engine.reshard.ReshardStats` has the measured per-rank figures).

    Raises:
        ValueError: ``model_bytes`` < 0.
    """
    if model_bytes < 0:
        raise ValueError(f"model_bytes must be >= 0, got {model_bytes}")
    tp_total, gen_total = layout.tp * layout.pp, layout.gen_tp * layout.gen_pp
    mb = Fraction(model_bytes)
    return ReshardCost(
        model_bytes=model_bytes,
        training_bytes=float(mb / tp_total),
        micro_dp_bytes=float(Fraction(tp_total - gen_total, gen_total * tp_total) * mb),
        micro_dp_peak_bytes=float(mb / gen_total),
        naive_bytes=float(Fraction(tp_total - 1, tp_total) * mb),
        naive_peak_bytes=float(mb),
    )


def expert_sync_bytes_received(layout: HybridLayout, expert_bytes: int) -> Fraction:
    """Bytes of expert weights each rank receives in one streamed weight sync.

    Every generation rank must hold all ``E`` experts of the layers of its generation stage,
    each TP-sharded ``1/t_g`` (vLLM's fused-MoE layer without expert parallelism), i.e.
    ``M_E / (t_g * p_g)`` for experts of ``M_E`` bytes in all (equal stages). It already holds
    its training shard of them, ``E/ep`` experts of its own stage at ``1/t``:
    ``M_E / (ep * t * p)``. Everything else arrives once, so

        received = M_E / (t_g * p_g) - M_E / (ep * t * p)

    (HybridFlow's micro-DP term ``(t*p - t_g*p_g) / (t_g*p_g*t*p) * M`` at ``ep = 1``). The
    route: the TP all-gather of the owning ranks (``(m-1)/m`` of each of its own stage's own
    experts), the fold broadcast of its other stages' own experts, and the expert-parallel
    broadcast (:attr:`HybridLayout.ep_groups`) of the ``E - E/ep`` experts other EP ranks own,
    whole generation shards. :class:`megaflow.hybrid_engine.reshard.ReshardStats` counts the
    expert part as ``expert_bytes_received``.

    Args:
        layout: the plan (``ep`` included).
        expert_bytes: ``M_E``, bytes of every expert weight of the model (all layers).

    Raises:
        ValueError: ``expert_bytes`` < 0.
    """
    if expert_bytes < 0:
        raise ValueError(f"expert_bytes must be >= 0, got {expert_bytes}")
    m_e = Fraction(expert_bytes)
    return m_e / (layout.gen_tp * layout.gen_pp) - m_e / (layout.ep * layout.tp * layout.pp)
