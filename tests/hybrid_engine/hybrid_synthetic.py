"""Synthetic Llama-style weights named like a megatron-core GPTModel, for HybridEngine tests.

The reference is built from *unfused* components (per-head q/k/v, gate, up, ...) drawn
from a seed, so every rank can rebuild the full model. A megatron TP shard is made the way
megatron defines it, independently of megaflow's code: ``linear_qkv`` = for each of the
rank's KV groups, its query heads, key head and value head; ``linear_fc1`` = the rank's
gate chunk then its up chunk; row-parallel weights split along dim 1; vocab-parallel
tensors along dim 0; norms whole.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    hidden: int = 16
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 2
    ffn: int = 12
    vocab: int = 32
    layers_per_stage: tuple[int, ...] = (2, 2)
    tied: bool = False
    norms: bool = True
    qkv_bias: bool = True

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)


def full_components(cfg: TinyConfig, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Unfused full tensors, keyed ``L{layer}.q`` etc. plus ``embed``/``output``/``final_norm``."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    h, hd = cfg.hidden, cfg.head_dim
    comps = {"embed": rnd(cfg.vocab, h), "final_norm": rnd(h)}
    comps["output"] = comps["embed"] if cfg.tied else rnd(cfg.vocab, h)
    for i in range(cfg.num_layers):
        comps.update({
            f"L{i}.q": rnd(cfg.heads * hd, h), f"L{i}.k": rnd(cfg.kv_heads * hd, h),
            f"L{i}.v": rnd(cfg.kv_heads * hd, h), f"L{i}.q_bias": rnd(cfg.heads * hd),
            f"L{i}.k_bias": rnd(cfg.kv_heads * hd), f"L{i}.v_bias": rnd(cfg.kv_heads * hd),
            f"L{i}.proj": rnd(h, cfg.heads * hd), f"L{i}.gate": rnd(cfg.ffn, h),
            f"L{i}.up": rnd(cfg.ffn, h), f"L{i}.fc2": rnd(h, cfg.ffn),
            f"L{i}.input_norm": rnd(h), f"L{i}.pre_mlp_norm": rnd(h)})
    return comps


def _qkv_rows(cfg: TinyConfig, q, k, v, groups: range) -> torch.Tensor:
    """Megatron fused QKV rows of the given KV groups (q heads of the group, k, v)."""
    n_rep, hd = cfg.heads // cfg.kv_heads, cfg.head_dim
    parts = []
    for grp in groups:
        parts += [q[grp * n_rep * hd:(grp + 1) * n_rep * hd], k[grp * hd:(grp + 1) * hd],
                  v[grp * hd:(grp + 1) * hd]]
    return torch.cat(parts, dim=0)


def megatron_shard(cfg: TinyConfig, comps: dict[str, torch.Tensor], *, tp: int, tp_rank: int,
                   layers: range, layer_offset: int, first_stage: bool,
                   last_stage: bool) -> dict[str, torch.Tensor]:
    """The megatron TP shard ``tp_rank`` of ``tp`` for the given global layers.

    Names use ``layer index - layer_offset`` (local indices on a training stage, global with
    offset 0). Tied embeddings: ``output_layer.weight`` exists only when the shard holds the
    last stage but not the first (megatron keeps a copy on the last stage when pp > 1).
    """
    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.chunk(t, tp, dim=dim)[tp_rank].clone()

    groups_per_rank = cfg.kv_heads // tp
    groups = range(tp_rank * groups_per_rank, (tp_rank + 1) * groups_per_rank)
    out: dict[str, torch.Tensor] = {}
    if first_stage:
        out["embedding.word_embeddings.weight"] = chunk(comps["embed"], 0)
    for i in layers:
        p = f"decoder.layers.{i - layer_offset}."

        def c(key: str, i: int = i) -> torch.Tensor:
            return comps[f"L{i}.{key}"]

        if cfg.norms:
            out[p + "input_layernorm.weight"] = c("input_norm").clone()
        out[p + "self_attention.linear_qkv.weight"] = _qkv_rows(cfg, c("q"), c("k"), c("v"), groups)
        if cfg.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = _qkv_rows(
                cfg, c("q_bias"), c("k_bias"), c("v_bias"), groups)
        out[p + "self_attention.linear_proj.weight"] = chunk(c("proj"), 1)
        if cfg.norms:
            out[p + "pre_mlp_layernorm.weight"] = c("pre_mlp_norm").clone()
        out[p + "mlp.linear_fc1.weight"] = torch.cat([chunk(c("gate"), 0), chunk(c("up"), 0)])
        out[p + "mlp.linear_fc2.weight"] = chunk(c("fc2"), 1)
    if last_stage:
        if cfg.norms:
            out["decoder.final_layernorm.weight"] = comps["final_norm"].clone()
        if not cfg.tied or not first_stage:
            out["output_layer.weight"] = chunk(comps["output"], 0)
    return out


def stage_layers(cfg: TinyConfig, stages: range) -> range:
    """Global layer indices of consecutive training ``stages``."""
    first = sum(cfg.layers_per_stage[: stages.start])
    return range(first, first + sum(cfg.layers_per_stage[s] for s in stages))


def training_shard(cfg: TinyConfig, comps, *, tp: int, tp_rank: int, pp_rank: int):
    """Named parameters of one training rank (local layer indices)."""
    pp = len(cfg.layers_per_stage)
    layers = stage_layers(cfg, range(pp_rank, pp_rank + 1))
    return megatron_shard(cfg, comps, tp=tp, tp_rank=tp_rank, layers=layers,
                          layer_offset=layers.start, first_stage=pp_rank == 0,
                          last_stage=pp_rank == pp - 1)


def generation_shard(cfg: TinyConfig, comps, *, gen_tp: int, gen_tp_rank: int, stages: range):
    """Expected generation shard: megatron TP = gen_tp shard of the folded ``stages``,
    global layer names."""
    pp = len(cfg.layers_per_stage)
    return megatron_shard(cfg, comps, tp=gen_tp, tp_rank=gen_tp_rank,
                          layers=stage_layers(cfg, stages), layer_offset=0,
                          first_stage=0 in stages, last_stage=pp - 1 in stages)


def model_bytes(cfg: TinyConfig, comps) -> int:
    """M: bytes of the unsharded model (tied embeddings counted once)."""
    keys = [k for k in comps if not (cfg.tied and k == "output")]
    if not cfg.norms:
        keys = [k for k in keys if "norm" not in k]
    if not cfg.qkv_bias:
        keys = [k for k in keys if "bias" not in k]
    return sum(comps[k].numel() * comps[k].element_size() for k in keys)
