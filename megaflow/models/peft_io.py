"""Megatron LoRA adapters <-> Hugging Face PEFT adapters (``adapter_config.json`` + ``adapter_model.safetensors``).

The Megatron side follows the LoRA contract of issue 35: for a wrapped linear at module path ``P``
(``decoder.layers.{i}.self_attention.linear_qkv``, ``...linear_proj``, ``decoder.layers.{i}.mlp.linear_fc1``,
``...linear_fc2``) the adapter is ``P.lora_a.weight [rank, in]`` and ``P.lora_b.weight [out, rank]``, and the layer
computes ``y = W x + (alpha / rank) B A x`` (Hu et al. 2021, "LoRA", eq. 3). A *full* adapter dict is the TP = 1
layout with global layer numbers: ``linear_qkv``'s B rows interleaved per query group and ``linear_fc1``'s B rows
``[gate; up]``, exactly like the base weights of :mod:`megaflow.models.hf_mapping`. TP-sharded pieces (one dict per
TP rank, the same names) are accepted too: column-parallel layers (qkv, fc1) hold A replicated and their slice of
B's rows, row-parallel layers (proj, fc2) their slice of A's columns and B replicated.

The PEFT side (peft's ``LoraModel`` on a transformers ``*ForCausalLM``) names each adapted HF linear
``base_model.model.{hf module}.lora_A.weight [r, in]`` / ``.lora_B.weight [out, r]``, with scale
``lora_alpha / r`` (no rsLoRA, no DoRA, no bias). A fused Megatron module becomes several HF modules:

* ``linear_qkv`` -> ``q_proj, k_proj, v_proj`` and ``linear_fc1`` -> ``gate_proj, up_proj``: every part gets the
  *same* A, and B's rows are split with the base weight's own transform (``split_qkv`` de-interleaves per query
  group, ``split_gate_up``), because ``B_part A`` are then exactly the rows of ``B A`` that belong to the part: the
  export is exact, no SVD.
* ``linear_proj`` -> ``o_proj`` and ``linear_fc2`` -> ``down_proj``: copied.

The row transforms are :func:`megaflow.models.hf_mapping.megatron_shards_to_hf` /
:func:`~megaflow.models.hf_mapping.hf_to_megatron_shard` applied to B (the transforms act on dim 0 of any tensor),
so adapters and base weights can never disagree on a layout. Import refuses a PEFT adapter whose parts of one fused
module carry different A (no single Megatron A represents it), naming the module; parts a PEFT adapter does not
target (``q_proj, v_proj`` only is peft's Llama default) get zero B rows, which is exact.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megaflow.models.hf_mapping import (
    ModelSpec,
    ParamMapping,
    ShardLayout,
    find_mapping,
    hf_names,
    hf_shape,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
)
from megaflow.models.transforms import gather_tp, shard_tp

#: Megatron module names LoRA may wrap (the contract's ``target_modules``) -> the HF modules each becomes.
MEGATRON_TO_HF_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_TO_MEGATRON_MODULE = {hf: meg for meg, parts in MEGATRON_TO_HF_MODULES.items() for hf in parts}
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LORA_SUFFIX = re.compile(r"\.lora_([ab])\.weight$")
_PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that does not fit the model or cannot be represented on the other side (module named)."""


@dataclass(frozen=True)
class PeftAdapter:
    """A LoRA adapter in PEFT layout.

    Attributes:
        tensors: ``base_model.model.<hf module>.lora_A.weight [r, in]`` / ``.lora_B.weight [out, r]``.
        rank: ``r``.
        alpha: ``lora_alpha`` (scale ``alpha / r``).
        target_modules: HF module leaf names adapted (sorted), e.g. ``["k_proj", "q_proj", "v_proj"]``.
    """

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    target_modules: list[str]

    @property
    def scale(self) -> float:
        """``alpha / rank`` (LoRA eq. 3)."""
        return self.alpha / self.rank


# ----------------------------------------------------------------------------------------------- Megatron -> PEFT
def _module_paths(adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """Megatron module paths ``P`` of an adapter dict, in first-seen order; every ``P`` needs both A and B."""
    paths: dict[str, set[str]] = {}
    for name in adapter:
        match = _LORA_SUFFIX.search(name)
        if match is None:
            raise AdapterError(f"{name!r} is not a LoRA adapter name (expected '<module>.lora_a.weight' or "
                               f"'<module>.lora_b.weight')")
        paths.setdefault(name[:match.start()], set()).add(match.group(1))
    for path, parts in paths.items():
        if parts != {"a", "b"}:
            (has,) = parts
            raise AdapterError(f"adapter of {path} has lora_{has} but not lora_{'b' if has == 'a' else 'a'}")
    return list(paths)


def _row_of(path: str, spec: ModelSpec) -> tuple[ParamMapping, int]:
    """The mapping row of the base weight ``P.weight`` (a LoRA target) and its layer number."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf not in MEGATRON_TO_HF_MODULES:
        raise AdapterError(f"adapter module {path}: LoRA targets are {sorted(MEGATRON_TO_HF_MODULES)}, not {leaf!r}")
    try:
        row, layer = find_mapping(path + ".weight", spec)
    except KeyError:
        raise AdapterError(f"adapter module {path} is not a module of this {spec.model_type} model "
                           f"(an expert or an unknown layer path)") from None
    if layer is None or not 0 <= layer < spec.num_layers:
        raise AdapterError(f"adapter module {path}: layer {layer} outside the model's {spec.num_layers} layers")
    return row, layer


def _peft_key(hf_weight_name: str, ab: str) -> str:
    return PEFT_PREFIX + hf_weight_name.removesuffix(".weight") + f".lora_{ab}.weight"


def _replicated(pieces: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
        raise AdapterError(f"{what} is replicated over TP but differs between TP ranks")
    return pieces[0]


def megatron_to_peft(adapter: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]], spec: ModelSpec,
                     *, alpha: float, kv_replication: int = 1) -> PeftAdapter:
    """Convert a Megatron LoRA adapter (full, or one dict per TP rank) into PEFT tensors.

    Args:
        adapter: the full adapter dict (TP = 1 layout, global layer numbers; names as in the module docstring), or
            a list of the TP ranks' dicts (index = TP rank) with the same names and each rank's local shapes.
        spec: the base model.
        alpha: LoRA alpha (scale ``alpha / rank``).
        kv_replication: KV-head replication of the TP layout (``transforms.kv_replication_factor``; 1 when
            ``tp <= num_key_value_heads``).

    Returns:
        The PEFT adapter; fused modules give one A per part (the same tensor values) and B split by rows.

    Raises:
        AdapterError: a name that is not an adapter of a LoRA target of this model (named), A or B missing, ranks
            that differ between modules, a replicated piece that differs between TP ranks, or shapes that do not
            match the model.
    """
    shards = [adapter] if isinstance(adapter, Mapping) else list(adapter)
    if not shards:
        raise AdapterError("megatron_to_peft: no adapter tensors")
    tensors: dict[str, torch.Tensor] = {}
    ranks: set[int] = set()
    targets: set[str] = set()
    for path in _module_paths(shards[0]):
        row, layer = _row_of(path, spec)
        a_pieces = [s[path + ".lora_a.weight"] for s in shards]
        b_pieces = [s[path + ".lora_b.weight"] for s in shards]
        if row.tp_dim == 0:  # column-parallel: A replicated, B sharded like the base weight's rows
            a = _replicated(a_pieces, f"{path}.lora_a.weight")
            b_parts = megatron_shards_to_hf(row, b_pieces, spec, kv_replication=kv_replication)
        else:  # row-parallel: A sharded like the base weight's columns, B replicated
            a = gather_tp(a_pieces, 1)
            b_parts = [_replicated(b_pieces, f"{path}.lora_b.weight")]
        for name, b in zip(hf_names(row, spec, layer), b_parts, strict=True):
            out_features, in_features = hf_shape(name, spec)
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, a.shape[0]):
                raise AdapterError(f"adapter of {path}: lora_a {tuple(a.shape)} / lora_b part for {name} "
                                   f"{tuple(b.shape)} do not fit the base weight [{out_features}, {in_features}]")
            tensors[_peft_key(name, "A")] = a.clone()  # own storage per part: safetensors refuses shared tensors
            tensors[_peft_key(name, "B")] = b.contiguous()
            targets.add(name.removesuffix(".weight").rsplit(".", 1)[-1])
        ranks.add(int(a.shape[0]))
    if len(ranks) != 1:
        raise AdapterError(f"adapter modules have different ranks {sorted(ranks)}; one LoRA rank is expected")
    return PeftAdapter(tensors, ranks.pop(), float(alpha), sorted(targets))


# ----------------------------------------------------------------------------------------------- PEFT -> Megatron
def _group_peft(tensors: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[tuple[str, int], dict[str, tuple]]:
    """``(megatron module leaf, layer) -> {hf weight name: (A, B)}`` of a PEFT adapter's tensors."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise AdapterError(f"PEFT tensor {key!r} is not a LoRA A/B weight of a linear module "
                               f"(embedding adapters, DoRA magnitudes and modules_to_save are not supported)")
        by_module.setdefault(match.group("module"), {})[match.group("ab")] = tensor
    groups: dict[tuple[str, int], dict[str, tuple]] = {}
    layer_re = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
    for module, ab in by_module.items():
        match = layer_re.match(module)
        if match is None or match.group(3) not in HF_TO_MEGATRON_MODULE:
            raise AdapterError(f"PEFT adapter module {module!r} has no Megatron LoRA target; supported: "
                               f"model.layers.N.self_attn.{{q,k,v,o}}_proj, model.layers.N.mlp.{{gate,up,down}}_proj")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"PEFT adapter module {module} has lora_{''.join(ab)} only")
        layer = int(match.group(1))
        if layer >= spec.num_layers:
            raise AdapterError(f"PEFT adapter module {module}: the model has {spec.num_layers} layers")
        groups.setdefault((HF_TO_MEGATRON_MODULE[match.group(3)], layer), {})[module + ".weight"] = (ab["A"], ab["B"])
    return groups


def _model_order(item: tuple[tuple[str, int], Any]) -> tuple[int, int]:
    (leaf, layer), _ = item
    return layer, list(MEGATRON_TO_HF_MODULES).index(leaf)


def _megatron_path(row: ParamMapping, layer: int) -> str:
    return row.megatron[0].format(layer=layer).removesuffix(".weight")


def _row_for(leaf: str, spec: ModelSpec) -> ParamMapping:
    probe = f"decoder.layers.0.{'self_attention' if leaf in ('linear_qkv', 'linear_proj') else 'mlp'}.{leaf}.weight"
    return find_mapping(probe, spec)[0]


def _fused_a(module: str, names: Sequence[str], parts: Mapping[str, tuple]) -> torch.Tensor:
    """The one A of a fused Megatron module: every present HF part must carry the same A."""
    present = [n for n in names if n in parts]
    first = parts[present[0]][0]
    for name in present[1:]:
        if not torch.equal(parts[name][0], first):
            raise AdapterError(f"{module}: lora_A of {present[0].rsplit('.', 2)[-2]} and "
                               f"{name.rsplit('.', 2)[-2]} differ; Megatron's fused {module.rsplit('.', 1)[-1]} has "
                               f"one A shared by its parts, so this adapter has no exact Megatron form")
    return first


def peft_to_megatron(adapter: PeftAdapter, spec: ModelSpec,
                     layout: ShardLayout | None = None) -> dict[str, torch.Tensor]:
    """Convert PEFT tensors into Megatron adapter tensors (the full dict, or one TP rank's piece).

    Args:
        adapter: from :func:`read_peft_adapter` or :func:`megatron_to_peft`.
        spec: the base model.
        layout: the TP rank to build (default: the full TP = 1 dict).

    Returns:
        ``{P.lora_a.weight: [rank, in_local], P.lora_b.weight: [out_local, rank]}`` for every adapted module, in
        model order. Parts of a fused module the adapter does not target get zero B rows (exact).

    Raises:
        AdapterError: a tensor that is not a LoRA A/B of a supported linear, a layer past the model, the parts of a
            fused module with different A (module and parts named), or shapes that do not fit the model.
    """
    layout = layout or ShardLayout()
    out: dict[str, torch.Tensor] = {}
    for (leaf, layer), parts in sorted(_group_peft(adapter.tensors, spec).items(), key=_model_order):
        row = _row_for(leaf, spec)
        names = hf_names(row, spec, layer)
        path = _megatron_path(row, layer)
        a = _fused_a(path, names, parts)
        bs = []
        for name in names:
            out_features, in_features = hf_shape(name, spec)
            b = parts[name][1] if name in parts else a.new_zeros(out_features, a.shape[0])
            if a.shape != (adapter.rank, in_features) or b.shape != (out_features, adapter.rank):
                raise AdapterError(f"PEFT adapter of {name.removesuffix('.weight')}: lora_A {tuple(a.shape)} / "
                                   f"lora_B {tuple(b.shape)} do not fit rank {adapter.rank} and the base weight "
                                   f"[{out_features}, {in_features}]")
            bs.append(b)
        if row.tp_dim == 0:
            out[path + ".lora_a.weight"] = a.contiguous()
            out[path + ".lora_b.weight"] = hf_to_megatron_shard(row, bs, spec, layout)
        else:
            out[path + ".lora_a.weight"] = shard_tp(a, 1, layout.tp_size, layout.tp_rank)
            out[path + ".lora_b.weight"] = bs[0].contiguous()
    if not out:
        raise AdapterError("the PEFT adapter has no LoRA tensors")
    return out


def megatron_target_modules(adapter: PeftAdapter) -> list[str]:
    """The contract's ``target_modules`` (Megatron names, sorted) an imported adapter needs."""
    return sorted({HF_TO_MEGATRON_MODULE[m] for m in adapter.target_modules})


# ----------------------------------------------------------------------------------------------- files
def write_peft_adapter(adapter: PeftAdapter, out_dir: str | os.PathLike, *, base_model: str | os.PathLike,
                       dropout: float = 0.0, dtype: torch.dtype | None = None) -> Path:
    """Write ``adapter_config.json`` (peft's ``LoraConfig``) and ``adapter_model.safetensors`` into ``out_dir``.

    Args:
        adapter: the tensors and hyper-parameters.
        out_dir: created when missing; the two files are replaced when present (each written to a temporary name and
            renamed, so a reader never sees a half-written file).
        base_model: the base model's name or path (``base_model_name_or_path``, what ``PeftModel`` records).
        dropout: ``lora_dropout`` recorded in the config (training only).
        dtype: dtype of the saved tensors (default: as given).

    Returns:
        ``out_dir`` as a Path.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alpha: Any = int(adapter.alpha) if float(adapter.alpha).is_integer() else adapter.alpha  # peft types it int
    config = LoraConfig(r=adapter.rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(adapter.target_modules), bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=str(base_model))
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous()
               for k, v in adapter.tensors.items()}
    tmp = out / f".{ADAPTER_WEIGHTS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    config_tmp = out / f".{ADAPTER_CONFIG}.tmp"
    config_tmp.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=_json_default))
    os.replace(config_tmp, out / ADAPTER_CONFIG)
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    return str(value)


def read_peft_adapter(adapter_dir: str | os.PathLike) -> PeftAdapter:
    """Read a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        AdapterError: a missing file, not a LoRA adapter, or a feature megaflow's Megatron LoRA does not compute
            (rsLoRA, DoRA, per-module rank/alpha patterns, trained biases, modules_to_save), named by its config key.
    """
    from safetensors.torch import load_file

    directory = Path(adapter_dir)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"PEFT adapter directory {directory} has no {path.name}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{config_path} is not valid JSON: {err}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type={config.get('peft_type')!r}, only LORA adapters are supported")
    refused = {"use_rslora": False, "use_dora": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
               "modules_to_save": None}
    for key, allowed in refused.items():
        value = config.get(key, allowed)
        if value not in (allowed, None, [], {}) or (key == "bias" and value != "none"):
            raise AdapterError(f"{config_path}: {key}={value!r} is not supported (megaflow's LoRA computes "
                               f"W x + lora_alpha / r * B A x on linear layers only)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"{config_path}: r={rank!r} and lora_alpha={alpha!r} must be a positive int and a number")
    tensors = load_file(str(weights_path))
    targets = sorted({m.group("module").rsplit(".", 1)[-1] for k in tensors if (m := _PEFT_KEY.match(k))})
    return PeftAdapter(tensors, rank, float(alpha), targets)


# ----------------------------------------------------------------------------------------------- merge
def merge_adapter_into_hf_dir(hf_dir: str | os.PathLike, adapter_dir: str | os.PathLike,
                              out_dir: str | os.PathLike, *, overwrite: bool = False,
                              max_shard_bytes: int = 2 * 1024**3) -> Path:
    """Write a full HF checkpoint with a PEFT LoRA adapter merged in: ``W + (lora_alpha / r) B A`` per adapted linear.

    The delta is computed as peft's ``LoraLayer.merge`` computes it (``(B @ A) * scale`` in float32, added to the
    weight in float32, cast back to the checkpoint's dtype). Tensors are read and written one at a time
    (safetensors shards of at most ``max_shard_bytes``); ``config.json`` and the tokenizer/generation files are
    copied; the directory appears atomically (nothing is left behind on an error).

    Args:
        hf_dir: the base model (an HF directory megaflow can read: llama, qwen2, qwen3 dense).
        adapter_dir: the PEFT adapter (:func:`read_peft_adapter`).
        out_dir: the merged checkpoint directory.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir`` (absolute).

    Raises:
        CheckpointError: the base directory is missing, incomplete or mis-shaped (from :func:`check_hf_dir`).
        AdapterError: the adapter is not a supported LoRA adapter, or names a module the base lacks, or its A / B
            do not fit the base weight (module named).
        FileExistsError: ``out_dir`` exists without ``overwrite``.
    """
    from megaflow.models.hf_io import HFShardWriter, HFWeights, check_hf_dir, copy_tokenizer_files
    from megaflow.utils.atomic_dir import atomic_directory

    check_hf_dir(hf_dir)
    adapter = read_peft_adapter(adapter_dir)
    base = HFWeights(hf_dir)
    deltas = _adapter_modules(adapter, base)
    with atomic_directory(out_dir, overwrite=overwrite) as work:
        writer = HFShardWriter(work, max_shard_bytes)
        for name in base.keys():
            weight = base.get(name)
            if name in deltas:
                a, b = deltas[name]
                weight = (weight.float() + (b.float() @ a.float()) * adapter.scale).to(weight.dtype)
            writer.add(name, weight)
        writer.close()
        shutil.copy2(Path(hf_dir) / "config.json", work / "config.json")
        copy_tokenizer_files(hf_dir, work)
    return Path(out_dir).absolute()


def _adapter_modules(adapter: PeftAdapter, base: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name -> (A, B) of every adapted linear, checked against the base checkpoint's shapes."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.tensors.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise AdapterError(f"PEFT tensor {key!r} is not a LoRA A/B weight of a linear module")
        pairs.setdefault(match.group("module") + ".weight", {})[match.group("ab")] = tensor
    out = {}
    for name, ab in pairs.items():
        module = name.removesuffix(".weight")
        if name not in base:
            raise AdapterError(f"PEFT adapter module {module} is not a linear of the base checkpoint")
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"PEFT adapter module {module} has lora_{''.join(ab)} only")
        out_features, in_features = base.shape(name)
        a, b = ab["A"], ab["B"]
        if a.shape != (adapter.rank, in_features) or b.shape != (out_features, adapter.rank):
            raise AdapterError(f"PEFT adapter module {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                               f"not fit rank {adapter.rank} and the base weight [{out_features}, {in_features}]")
        out[name] = (a, b)
    return out


__all__ = ["AdapterError", "PeftAdapter", "MEGATRON_TO_HF_MODULES", "HF_TO_MEGATRON_MODULE", "PEFT_PREFIX",
           "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "megatron_to_peft", "peft_to_megatron", "megatron_target_modules",
           "write_peft_adapter", "read_peft_adapter",
           "merge_adapter_into_hf_dir"]
