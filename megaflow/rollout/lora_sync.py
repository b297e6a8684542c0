"""Adapter-only weight sync to vLLM: the actor's LoRA adapters, written once per sync in PEFT layout, served on the
frozen base weights under a versioned id (issue 35, route ``actor.lora.sync == "adapter"``).

Per sync (:meth:`AdapterSync.sync`, every rank of a generation TP group in lockstep, each with the same adapter):

1. the Megatron adapter (the full dict, or the TP ranks' pieces) becomes PEFT tensors
   (:func:`megaflow.models.peft_io.megatron_to_peft`) and is written as ``adapter_config.json`` +
   ``adapter_model.safetensors`` into ``<run dir>/v<version>``; the run directory is private to the run (created
   with ``mkdtemp``, mode 0700) on memory-backed storage (``/dev/shm`` where it exists). The version's files are
   removed as soon as vLLM has loaded and the contract check passed (vLLM 0.32 reads them once, in ``add_lora``,
   and keeps the tensors in memory), and also when the load fails, so a crash leaves at most the one adapter being
   loaded; the run directory goes at :meth:`AdapterSync.close` (see *Lifetime* below);
2. vLLM loads it as ``LoRARequest("megaflow-v<version>", version + 1, path)``. A version synced a second time (a
   retried step) is reloaded *in place* under its id (``load_inplace=True``; vLLM 0.32 loads the new tensors first
   and replaces the old ones only when that succeeded). Generation uses a request without ``load_inplace``: vLLM
   re-reads an in-place request's directory at every engine step that uses it;
3. the contract check (:func:`check_loaded_adapter`) compares what vLLM holds with what was exported, module by
   module: every exported HF module must sit in the packed vLLM module it belongs to (``q/k/v_proj`` ->
   ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``) at its slot, with A equal and B equal to ``(alpha / r) B``
   (vLLM folds the scale into B), and vLLM must hold nothing for a module the model lacks (vLLM 0.32 only checks a
   module's *leaf* name, so an adapter for layer 7 of a 2-layer model loads and is silently ignored). Any
   difference raises :class:`AdapterSyncError` naming the module;
4. generation switches to the new version, and versions older than ``version - staleness`` are unloaded: with a
   staleness bound ``k`` (rollouts may come from a policy up to ``k`` syncs old) the engine keeps ``k + 1``
   versions. Its LRU capacity (``VLLMRolloutConfig.max_lora_versions``, vLLM's ``max_cpu_loras``) must be at least
   ``k + 2``: vLLM 0.32 loads a new adapter before anything is unloaded and, when full, evicts its least recently
   used one on its own, so with ``k + 1`` slots a sync that then fails would already have lost a version still
   inside the bound.

Lifetime of the run directory: it is named ``megaflow-lora-<pid>-<random>`` after the process that made it
(:func:`megaflow.launch.watchdog.temp_prefix`) and removed on every exit a process can handle:

* :meth:`AdapterSync.close` (or leaving its ``with`` block, normally or by an exception);
* a Ray worker's shutdown: the worker group calls every role's ``close`` before it kills the rank's process
  (:meth:`megaflow.single_controller.host.WorkerHost.close_roles`; ``ray.kill`` itself ends the process with
  ``_exit``, which skips ``atexit``), and the actor's ``close`` closes this object
  (:meth:`megaflow.workers.weight_sync.ActorWeightSync.close`);
* interpreter exit (``atexit``), which also covers a SIGTERM to a Ray worker (Ray turns it into ``sys.exit``).

A process killed by SIGKILL (or ended by ``os._exit`` without a close) cannot remove its directory: the next
:class:`AdapterSync` made on the machine removes the run directories whose owner pid is no longer alive
(:func:`remove_stale_run_dirs`), never those of a live process, so two concurrent runs never delete each other's
(as :mod:`megaflow.rollout.vllm_shm`, this assumes the processes sharing ``/dev/shm`` share one pid namespace).

vLLM internals relied on (vLLM 0.32; listed in :mod:`megaflow.rollout.vllm_compat`): ``LoRARequest(lora_name,
lora_int_id, lora_path, load_inplace)``; ``LLMEngine.add_lora / remove_lora / list_loras``; ``LLM.generate(...,
lora_request=)``; on the worker ``model_runner.lora_manager`` (``LoRAModelRunnerMixin``), its ``_adapter_manager``
(``WorkerLoRAManager``) with ``get_adapter(id).loras`` (``LoRAModel``), ``modules`` and
``packed_modules_mapping`` (``LoRAModelManager``), and the ``lora_a`` / ``lora_b`` of ``LoRALayerWeights`` /
``PackedLoRALayerWeights`` (lists per packed slot, B pre-multiplied by the scale in ``optimize``).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megaflow.launch.watchdog import temp_prefix
from megaflow.models.hf_mapping import ModelSpec
from megaflow.models.peft_io import PEFT_PREFIX, PeftAdapter, megatron_to_peft, write_peft_adapter
from megaflow.rollout.vllm_shm import dead_owner_names

_LORA_PARAM = re.compile(r"\.lora_[ab]\.weight$")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
#: Memory-backed storage for the adapter files (falls back to the temp dir where it does not exist).
SHM_ROOT = "/dev/shm"
#: The kind in a run directory's name, ``megaflow-lora-<owner pid>-<random>`` (:func:`temp_prefix`).
RUN_DIR_KIND = "lora"
#: ``temp_prefix(RUN_DIR_KIND, pid)`` + mkdtemp's random part (a pid has at most 7 digits: Linux's pid_max <= 2^22).
_RUN_DIR = re.compile(rf"^megaflow-{RUN_DIR_KIND}-(\d{{1,7}})-.+$")


class AdapterSyncError(RuntimeError):
    """vLLM rejected an adapter or holds it differently from what was exported (the module is named)."""


def default_root() -> str:
    """The parent of the run directories: :data:`SHM_ROOT` where it exists and is writable, else the temp dir."""
    return SHM_ROOT if os.path.isdir(SHM_ROOT) and os.access(SHM_ROOT, os.W_OK) else tempfile.gettempdir()


def remove_stale_run_dirs(root: str | os.PathLike) -> list[Path]:
    """Remove the adapter run directories under ``root`` whose owner process is dead (killed by SIGKILL).

    Only directories named ``megaflow-lora-<pid>-<random>`` are considered; those of a live pid (this process, a
    concurrent run), other users' (permission denied) and any other name are left alone.

    Args:
        root: the parent of the run directories (``/dev/shm`` by default in :class:`AdapterSync`).

    Returns:
        The directories removed.
    """
    removed: list[Path] = []
    for name in dead_owner_names(root, _RUN_DIR):
        path = Path(root) / name
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError:  # removed by another run first, another user's: a clean-up never stops a run
            pass
    return removed


class AdapterSync:
    """Versioned adapter-only sync of LoRA adapters into one vLLM rollout engine (see the module docstring).

    Args:
        rollout: a :class:`megaflow.rollout.vllm_rollout.VLLMRollout` built with ``max_lora_rank > 0`` (or any object
            with its ``config``, ``add_lora``, ``remove_lora``, ``set_lora_request`` and ``call_on_worker``).
        spec: the base model (the adapter's names and shapes are checked against it).
        alpha: LoRA alpha (scale ``alpha / rank``), the trainer's ``actor.lora.alpha``.
        staleness: versions older than the newest that must stay usable (``k``; ``k + 1`` versions are kept).
        base_model: recorded as ``base_model_name_or_path`` in each ``adapter_config.json``.
        root: parent of the run directory (default ``/dev/shm``); stale run directories of dead processes there
            are removed first (:func:`remove_stale_run_dirs`).

    Raises:
        ValueError: the engine has no LoRA, or holds fewer than ``staleness + 2`` adapters (both named), or a
            negative staleness.
    """

    def __init__(self, rollout: Any, spec: ModelSpec, *, alpha: float, staleness: int = 0, base_model: str,
                 root: str | os.PathLike | None = None) -> None:
        config = rollout.config
        if config.max_lora_rank <= 0:
            raise ValueError("AdapterSync: the vLLM engine was built without LoRA (VLLMRolloutConfig.max_lora_rank=0)")
        if staleness < 0:
            raise ValueError(f"AdapterSync: staleness must be >= 0, got {staleness}")
        if config.max_lora_versions < staleness + 2:
            raise ValueError(f"AdapterSync: staleness {staleness} needs {staleness + 2} adapter slots in the engine "
                             f"({staleness + 1} kept versions and the one being loaded), it has "
                             f"VLLMRolloutConfig.max_lora_versions={config.max_lora_versions}")
        self.rollout, self.spec, self.alpha, self.staleness = rollout, spec, float(alpha), staleness
        self.base_model = str(base_model)
        parent = str(root or default_root())
        remove_stale_run_dirs(parent)
        self.directory = Path(tempfile.mkdtemp(prefix=temp_prefix(RUN_DIR_KIND), dir=parent))
        self._requests: dict[int, Any] = {}  # version -> LoRARequest, ascending
        atexit.register(self.close)

    # ------------------------------------------------------------------ sync
    def sync(self, adapter: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]], version: int, *,
             kv_replication: int = 1) -> Any:
        """Publish the actor's adapter as ``version`` and generate with it from now on.

        Args:
            adapter: the full Megatron adapter dict (TP = 1 layout, global layer numbers:
                ``decoder.layers.{i}.self_attention.linear_qkv.lora_a.weight [rank, hidden]``, ``...lora_b.weight
                [out, rank]``), or the list of the training TP ranks' pieces (:func:`megatron_to_peft`).
            version: the policy version (the trainer's weight version: >= 0, not below the newest kept version;
                equal to it reloads that version in place).
            kv_replication: KV-head replication of TP pieces (1 for a full dict).

        Returns:
            The loaded ``vllm.lora.request.LoRARequest`` (id ``version + 1``).

        Raises:
            megaflow.models.peft_io.AdapterError: the adapter does not fit the model (module named).
            ValueError: a version below the newest kept one, or an adapter rank above the engine's ``max_lora_rank``.
            AdapterSyncError: vLLM rejected the adapter or the contract check failed (module named); the version is
                unloaded and its directory removed.
        """
        peft = megatron_to_peft(adapter, self.spec, alpha=self.alpha, kv_replication=kv_replication)
        return self.publish(peft, version)

    def publish(self, adapter: PeftAdapter, version: int) -> Any:
        """:meth:`sync` for an adapter already in PEFT layout (same arguments, returns and errors)."""
        from vllm.lora.request import LoRARequest

        newest = max(self._requests, default=-1)
        if version < 0 or version < newest:
            raise ValueError(f"adapter version {version} is below the newest synced version {newest} (or negative)")
        if adapter.rank > self.rollout.config.max_lora_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds the engine's VLLMRolloutConfig.max_lora_rank="
                             f"{self.rollout.config.max_lora_rank}")
        path = write_peft_adapter(adapter, self.directory / f"v{version}", base_model=self.base_model)
        name, lora_id = f"megaflow-v{version}", version + 1
        try:
            self._load(LoRARequest(name, lora_id, str(path), load_inplace=version in self._requests), adapter)
        except BaseException:
            self._requests.pop(version, None)
            self.rollout.remove_lora(lora_id)
            raise
        finally:
            shutil.rmtree(path, ignore_errors=True)  # loaded into memory, or failed: the files are not read again
        request = LoRARequest(name, lora_id, str(path))
        self._requests[version] = request
        self.rollout.set_lora_request(request)
        self._evict(version)
        return request

    def _load(self, request: Any, adapter: PeftAdapter) -> None:
        try:
            self.rollout.add_lora(request)
        except (ValueError, KeyError, RuntimeError, OSError) as exc:  # vLLM's loader errors name the modules
            raise AdapterSyncError(f"vLLM rejected adapter version {request.lora_int_id - 1} ({request.lora_path}): "
                                   f"{exc}") from exc
        check_loaded_adapter(self.rollout.call_on_worker(loaded_lora_modules, request.lora_int_id), adapter)

    def _evict(self, newest: int) -> None:
        for version in [v for v in self._requests if v < newest - self.staleness]:
            self.rollout.remove_lora(self._requests.pop(version).lora_int_id)

    # ------------------------------------------------------------------ queries, lifetime
    @property
    def versions(self) -> list[int]:
        """The versions loaded in the engine, ascending (at most ``staleness + 1``)."""
        return sorted(self._requests)

    def request_for(self, version: int) -> Any:
        """The ``LoRARequest`` of a kept version (for a rollout that must use an older policy).

        Raises:
            KeyError: the version was evicted or never synced (the kept ones named).
        """
        if version not in self._requests:
            raise KeyError(f"adapter version {version} is not loaded; kept versions {self.versions} "
                           f"(staleness bound {self.staleness})")
        return self._requests[version]

    def close(self) -> None:
        """Remove the run directory (idempotent; also runs at interpreter exit). The engine keeps what it loaded.

        A process killed by SIGKILL cannot run this: its directory is removed by the next :class:`AdapterSync` on
        the machine (:func:`remove_stale_run_dirs`)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> AdapterSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- the trainer's side
def local_adapter_tensors(model_chunks: Any) -> dict[str, torch.Tensor]:
    """This rank's LoRA adapter parameters under the contract's names with *global* layer numbers.

    Args:
        model_chunks: this rank's GPTModel or list of (virtual pipeline) chunks, possibly DDP-wrapped.

    Returns:
        ``{decoder.layers.<global i>.<...>.lora_a.weight: [rank, in_local], ...lora_b.weight: [out_local, rank]}``
        (detached, on the CPU): this TP rank's pieces of this pipeline stage's layers.
    """
    from megaflow.models.weights import unwrap_model_chunks

    out = {}
    for chunk in unwrap_model_chunks(model_chunks):
        decoder: Any = chunk.decoder
        global_layer = [layer.layer_number - 1 for layer in decoder.layers]
        for name, param in chunk.named_parameters():
            if not _LORA_PARAM.search(name):
                continue
            match = _LOCAL_LAYER.match(name)
            if match is not None:
                name = f"decoder.layers.{global_layer[int(match.group(1))]}.{name[match.end():]}"
            out[name] = param.detach().cpu()
    return out


def gather_adapter_pieces(local: Mapping[str, torch.Tensor], *, tp_group: Any,
                          pp_group: Any) -> list[dict[str, torch.Tensor]]:
    """Collective over the actor's TP and PP groups: every rank gets the whole adapter as one dict per TP rank.

    The stages' layers are joined over ``pp_group`` first, then the TP ranks' pieces are gathered over
    ``tp_group``: the list :func:`megaflow.models.peft_io.megatron_to_peft` (and :meth:`AdapterSync.sync`) take.
    Adapters are small (``rank * (in + out)`` per linear), so they travel as pickled objects.

    Args:
        local: :func:`local_adapter_tensors` of this rank.
        tp_group, pp_group: the training process groups (``ParallelInfo.tp_group`` / ``pp_group``).

    Returns:
        ``[piece of TP rank 0, piece of TP rank 1, ...]``, each with every layer's adapters.
    """
    import torch.distributed as dist

    stages: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, {k: v.detach().cpu() for k, v in local.items()}, group=pp_group)
    joined = {k: v for stage in stages for k, v in stage.items()}
    pieces: list[Any] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(pieces, joined, group=tp_group)
    return pieces


# ---------------------------------------------------------------------- the contract check
def loaded_lora_modules(worker: Any, lora_int_id: int) -> dict[str, Any]:
    """Runs on the vLLM worker: what the engine holds for adapter ``lora_int_id``.

    Returns:
        ``{"loaded": {vLLM module: (list of A per slot, list of B per slot)} (None for an empty slot),
        "modules": the model's LoRA-wrapped module names, "packed": packed module leaf -> its parts}``;
        ``"loaded"`` is None when the adapter is not registered.
    """
    manager = worker.model_runner.lora_manager._adapter_manager
    model = manager.get_adapter(lora_int_id)
    loaded = None
    if model is not None:
        loaded = {}
        for name, weights in model.loras.items():
            a, b = weights.lora_a, weights.lora_b
            loaded[name] = (list(a) if isinstance(a, list) else [a], list(b) if isinstance(b, list) else [b])
    return {"loaded": loaded, "modules": sorted(manager.modules),
            "packed": {k: list(v) for k, v in manager.packed_modules_mapping.items()}}


def expected_vllm_slots(adapter: PeftAdapter, packed: Mapping[str, Sequence[str]]) -> dict[str, dict[int, tuple]]:
    """vLLM module -> {slot: (A, scaled B, HF module)} the PEFT adapter must become in the engine."""
    slot_of = {part: (leaf, i) for leaf, parts in packed.items() for i, part in enumerate(parts)}
    expected: dict[str, dict[int, tuple]] = {}
    for key, a in adapter.tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        parent, leaf = module.rsplit(".", 1)
        packed_leaf, slot = slot_of.get(leaf, (leaf, 0))
        b = adapter.tensors[key.replace(".lora_A.", ".lora_B.")] * adapter.scale
        expected.setdefault(f"{parent}.{packed_leaf}", {})[slot] = (a, b, module)
    return expected


def check_loaded_adapter(held: Mapping[str, Any], adapter: PeftAdapter, atol: float = 1e-6) -> None:
    """Fail loudly, naming the module, when vLLM holds the adapter differently from the PEFT export.

    Args:
        held: :func:`loaded_lora_modules` of the adapter.
        adapter: what was written.
        atol: B tolerance (vLLM multiplies B by the scale in the adapter's dtype; A must be equal).

    Raises:
        AdapterSyncError: the adapter is not registered; vLLM holds weights for a module the model does not
            wrap (mis-mapped: never applied); an exported module is missing or in the wrong packed slot; an A or B
            that differs (module, slot and the largest difference named).
    """
    loaded = held["loaded"]
    if loaded is None:
        raise AdapterSyncError("vLLM does not list the adapter just loaded")
    modules = set(held["modules"])
    stray = sorted(set(loaded) - modules)
    if stray:
        raise AdapterSyncError(f"vLLM mis-maps adapter modules {stray}: the served model has no such LoRA module, "
                               f"so they would never be applied")
    expected = expected_vllm_slots(adapter, held["packed"])
    unexpected = sorted(set(loaded) - set(expected))
    if unexpected:
        raise AdapterSyncError(f"vLLM holds adapter weights for {unexpected}, which the export does not have")
    for vllm_module, slots in sorted(expected.items()):
        for slot, (a, b, module) in sorted(slots.items()):
            if vllm_module not in loaded:
                raise AdapterSyncError(f"adapter module {module}: vLLM loaded nothing for {vllm_module}")
            got_a, got_b = (lst[slot] if slot < len(lst) else None for lst in loaded[vllm_module])
            if got_a is None or got_b is None:
                raise AdapterSyncError(f"adapter module {module}: vLLM's {vllm_module} has no weights in slot {slot}")
            if got_a.shape != a.shape or not torch.equal(got_a.float().cpu(), a.float()):
                raise AdapterSyncError(f"adapter module {module}: vLLM's {vllm_module} slot {slot} holds a different "
                                       f"lora_A ({tuple(got_a.shape)} vs {tuple(a.shape)})")
            diff = (got_b.float().cpu() - b.float()).abs().max() if got_b.shape == b.shape else float("inf")
            if diff > atol * max(1.0, float(b.abs().max())):
                raise AdapterSyncError(f"adapter module {module}: vLLM's {vllm_module} slot {slot} holds a different "
                                       f"lora_B ({tuple(got_b.shape)} vs {tuple(b.shape)}, max difference {diff})")


__all__ = ["AdapterSync", "AdapterSyncError", "SHM_ROOT", "check_loaded_adapter", "default_root",
           "expected_vllm_slots", "gather_adapter_pieces", "loaded_lora_modules", "local_adapter_tensors",
           "remove_stale_run_dirs"]
