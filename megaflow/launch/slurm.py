"""``python -m megaflow.launch.slurm``: write (and optionally submit) a megaflow sbatch script.

::

    python -m megaflow.launch.slurm --recipe llama70b_ppo --job-dir /shared/runs/70b \\
        --partition gpu --account proj --time 2-00:00:00 --image /shared/megaflow.sqsh \\
        trainer.total_epochs=2 --submit

The script (template ``tools/slurm/ray_cluster.sbatch.in``) starts a Ray head on the
first node and Ray workers on the others with ``srun``, waits (bounded) until the cluster
offers what the recipe's resource pools need (:mod:`megaflow.launch.wait`), runs the
controller ``python -m megaflow.trainer.main --recipe ... ray.address=HEAD:PORT`` on the
head node, logs to ``<job-dir>/slurm-<jobid>.out`` and ``<job-dir>/logs/<jobid>/``, and
stops Ray on every node on success, failure, time limit or ``scancel``.

Nodes and GPUs per node default to what the recipe needs
(:func:`megaflow.launch.resources.launch_requirements`); asking for fewer is refused
here, before anything is queued. The trainer writes under ``<job-dir>/outputs`` unless an
override sets ``trainer.output_dir``; reuse the job directory to resume
(``trainer.resume=auto``).
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megaflow.launch.resources import LaunchRequirements, launch_requirements

if TYPE_CHECKING:
    from megaflow.config import Config

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = REPO_ROOT / "tools" / "slurm" / "ray_cluster.sbatch.in"
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(UNLIMITED|INFINITE)$", re.IGNORECASE)


@dataclass(frozen=True)
class SlurmJob:
    """Everything the generated sbatch script needs besides the recipe's requirement.

    ``None`` for ``nodes`` / ``gpus_per_node`` means "what the recipe needs";
    ``cpus_per_node=None`` asks Slurm for whole nodes (``--exclusive``) and gives Ray all
    their CPUs. ``command=None`` runs the megaflow trainer; a custom command (tests,
    tools) gets the cluster address in ``$RAY_ADDRESS`` instead of ``ray.address=``.
    """

    recipe: str
    job_dir: Path
    overrides: tuple[str, ...] = ()
    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_node: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    job_name: str | None = None
    image: str | None = None
    container_mounts: tuple[str, ...] = ()
    python: str | None = None
    """Interpreter on the nodes; default: this one, or ``python`` inside ``image``."""
    workdir: str | None = None
    """Directory the steps run in; default: this repository (``/opt/megaflow`` in ``image``)."""
    interface: str | None = None
    ray_port: int = 6379
    ray_client_server_port: int = 10001
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    ray_start_args: tuple[str, ...] = ()
    wait_timeout_s: float | None = None
    """Bounded wait for the cluster; default: the recipe's ``ray.resource_wait_timeout_s``."""
    head_start_timeout_s: float = 180.0
    stop_timeout_s: float = 30.0
    sbatch_args: tuple[str, ...] = ()
    command: tuple[str, ...] | None = None


def check_job(job: SlurmJob, required: LaunchRequirements) -> list[str]:
    """Validate ``job`` against the recipe's requirement before anything is queued.

    Returns:
        Warnings (e.g. more nodes than the pools use).

    Raises:
        ValueError: fewer nodes, GPUs or CPUs per node than the recipe needs, a malformed
            time limit, port or sbatch argument (names the option and both numbers).
    """
    warnings = []
    for name in ("nodes", "gpus_per_node", "cpus_per_node"):
        value = getattr(job, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (0 if name == "gpus_per_node" else 1)):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {value!r}")
    if job.nodes is not None:
        if job.nodes < required.num_nodes:
            raise ValueError(f"--nodes={job.nodes}, but recipe {job.recipe!r} needs {required.describe()}; "
                             f"raise --nodes or shrink resources.nodes / resources.pools")
        if job.nodes > required.num_nodes:
            warnings.append(f"--nodes={job.nodes}: the recipe's pools use only {required.num_nodes}; "
                            f"the other nodes stay idle")
    if job.gpus_per_node is not None and job.gpus_per_node < required.gpus_per_node:
        raise ValueError(f"--gpus-per-node={job.gpus_per_node}, but recipe {job.recipe!r} needs "
                         f"{required.gpus_per_node} GPUs on a node ({required.describe()})")
    if job.cpus_per_node is not None and job.cpus_per_node < required.cpus_per_node:
        raise ValueError(f"--cpus-per-node={job.cpus_per_node}, but recipe {job.recipe!r} needs "
                         f"{required.cpus_per_node} CPUs on a node (resources.procs_per_node x "
                         f"resources.num_cpus_per_proc; {required.describe()})")
    if job.time is not None and not _SLURM_TIME.match(job.time):
        raise ValueError(f"--time={job.time!r} is not a Slurm time limit (MM, HH:MM:SS, D-HH[:MM[:SS]])")
    for name in ("ray_port", "ray_client_server_port", "dashboard_port"):
        port = getattr(job, name)
        if not 1024 <= port < 65536:
            raise ValueError(f"--{name.replace('_', '-')}={port}: use a port in 1024..65535")
    for arg in job.sbatch_args:
        if not arg.startswith("--") or "\n" in arg:
            raise ValueError(f"--sbatch-arg {arg!r}: expected one long sbatch option such as --qos=high")
    if job.dashboard and job.dashboard_host in ("0.0.0.0", "::"):
        warnings.append(f"the dashboard binds all interfaces ({job.dashboard_host}); anyone on the network "
                        "can reach it")
    return warnings


def _sbatch_directives(job: SlurmJob, required: LaunchRequirements, nodes: int, gpus: int) -> list[str]:
    job_dir = job.job_dir
    lines = [f"--job-name={job.job_name or 'megaflow-' + required.experiment}", f"--nodes={nodes}",
             "--ntasks-per-node=1", f"--output={job_dir}/slurm-%j.out", f"--error={job_dir}/slurm-%j.out"]
    lines.append(f"--cpus-per-task={job.cpus_per_node}" if job.cpus_per_node else "--exclusive")
    if gpus:
        lines.append(f"--gpus-per-node={gpus}")
    for flag, value in (("partition", job.partition), ("account", job.account), ("time", job.time)):
        if value:
            lines.append(f"--{flag}={value}")
    lines += list(job.sbatch_args)
    for line in lines:
        if any(c.isspace() for c in line):
            raise ValueError(f"sbatch option {line!r} contains whitespace (#SBATCH lines cannot quote it)")
    return [f"#SBATCH {line}" for line in lines]


def _bash_array(values) -> str:
    return "(" + " ".join(shlex.quote(str(v)) for v in values) + ")"


def _settings(job: SlurmJob, gpus: int, wait_timeout: float) -> list[str]:
    python = job.python or ("python" if job.image else sys.executable)
    workdir = job.workdir or ("/opt/megaflow" if job.image else str(REPO_ROOT))
    overrides = _overrides(job)
    if job.command is None:
        controller = [python, "-m", "megaflow.trainer.main", "--recipe", job.recipe, *overrides]
    else:
        controller = list(job.command)
    q = shlex.quote
    return [
        f"JOB_DIR={q(str(job.job_dir))}",
        f"WORKDIR={q(workdir)}",
        f"PYTHON={q(python)}",
        f"RECIPE={q(job.recipe)}",
        f"OVERRIDES={_bash_array(overrides)}",
        f"CONTROLLER={_bash_array(controller)}",
        f"CONTROLLER_TAKES_ADDRESS={'true' if job.command is None else 'false'}  # append ray.address=HEAD:PORT",
        f"GPUS_PER_NODE={gpus}",
        f"CPUS_PER_NODE={job.cpus_per_node or ''}  # empty: all CPUs Slurm gives the job on a node",
        f"NODE_INTERFACE={q(job.interface or '')}  # empty: the interface of the default route",
        f"RAY_PORT={job.ray_port}",
        f"RAY_CLIENT_SERVER_PORT={job.ray_client_server_port}",
        f"DASHBOARD={'true' if job.dashboard else 'false'}",
        f"DASHBOARD_HOST={q(job.dashboard_host)}",
        f"DASHBOARD_PORT={job.dashboard_port}",
        f"RAY_START_ARGS={_bash_array(job.ray_start_args)}",
        f"CONTAINER_IMAGE={q(job.image or '')}",
        f"CONTAINER_MOUNTS={q(','.join(job.container_mounts))}",
        f"WAIT_TIMEOUT_S={wait_timeout:g}  # bounded wait for the recipe's resources",
        f"HEAD_START_TIMEOUT_S={job.head_start_timeout_s:g}",
        f"STOP_TIMEOUT_S={job.stop_timeout_s:g}",
    ]


def _overrides(job: SlurmJob) -> list[str]:
    """The user's overrides, after a default ``trainer.output_dir`` in the job directory."""
    user = list(job.overrides)
    if any(o.split("=", 1)[0].strip() == "trainer.output_dir" for o in user):
        return user
    return [f"trainer.output_dir={job.job_dir / 'outputs'}", *user]


def load_job_config(job: SlurmJob) -> Config:
    """The recipe with the job's overrides, as the trainer will load it."""
    from megaflow.topology import load_run

    return load_run(job.recipe, _overrides(job))


def render_sbatch(job: SlurmJob, cfg: Config | None = None, template: Path = TEMPLATE) -> str:
    """The sbatch script for ``job`` (``cfg`` is loaded from the recipe when None).

    Raises:
        ValueError: see :func:`check_job`; a template placeholder without a value.
        ConfigError / FileNotFoundError: the recipe or its overrides are invalid.
    """
    cfg = load_job_config(job) if cfg is None else cfg
    required = launch_requirements(cfg)
    check_job(job, required)
    nodes = job.nodes or required.num_nodes
    gpus = required.gpus_per_node if job.gpus_per_node is None else job.gpus_per_node
    wait_timeout = cfg.ray.resource_wait_timeout_s if job.wait_timeout_s is None else job.wait_timeout_s
    values = {"SBATCH_DIRECTIVES": "\n".join(_sbatch_directives(job, required, nodes, gpus)),
              "SETTINGS": "\n".join(_settings(job, gpus, wait_timeout))}
    text = Path(template).read_text()
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    if missing:
        raise ValueError(f"template {template}: no value for placeholder(s) {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def write_sbatch(job: SlurmJob, path: Path | None = None, cfg: Config | None = None) -> Path:
    """Render the script and write it (default ``<job_dir>/megaflow-<recipe>.sbatch``, mode 0750)."""
    text = render_sbatch(job, cfg)
    job.job_dir.mkdir(parents=True, exist_ok=True)
    path = Path(path) if path else job.job_dir / f"megaflow-{Path(job.recipe).stem}.sbatch"
    path.write_text(text)
    path.chmod(0o750)
    return path


class SlurmSubmitError(RuntimeError):
    """sbatch refused the script, or Slurm says the cluster can never run it."""


def submit(script: Path, sbatch: str = "sbatch", env: dict[str, str] | None = None) -> int:
    """Submit ``script``; returns the job id.

    A pre-flight ``sbatch --test-only`` comes first: a job asking for more nodes, GPUs or
    CPUs than the partition has is otherwise accepted and left pending forever
    (``PartitionNodeLimit``); here it fails at once with Slurm's reason and the request.

    Raises:
        SlurmSubmitError: the pre-flight or the submission failed (Slurm's message and the
            script's ``#SBATCH`` request in the message).
    """
    request = " ".join(line.removeprefix("#SBATCH ") for line in Path(script).read_text().splitlines()
                       if line.startswith("#SBATCH --") and not line.startswith(("#SBATCH --output",
                                                                                 "#SBATCH --error")))
    for args, what in ((["--test-only"], "cannot run on this cluster"), (["--parsable"], "was refused")):
        proc = subprocess.run([sbatch, *args, str(script)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            reason = (proc.stderr or proc.stdout).strip().removeprefix("sbatch: error: ")
            raise SlurmSubmitError(f"the job {script} {what}: {reason} (it asks for {request})")
    return int(proc.stdout.strip().split(";")[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megaflow.launch.slurm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    p.add_argument("--job-dir", required=True, type=Path, help="shared directory for the script, logs, outputs")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: what the recipe needs)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the recipe's)")
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="CPUs per node for Ray (default: whole nodes, --exclusive)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00")
    p.add_argument("--job-name", default=None)
    p.add_argument("--image", default=None, help="container image for pyxis/enroot (srun --container-image)")
    p.add_argument("--container-mount", action="append", default=[], metavar="SRC:DST",
                   help="extra container mount (repeatable); the job dir is always mounted")
    p.add_argument("--python", default=None, help="interpreter on the nodes (default: this one; python in --image)")
    p.add_argument("--workdir", default=None, help="directory the steps run in (default: this repository)")
    p.add_argument("--interface", default=None, help="network interface Ray binds to (default: default route's)")
    p.add_argument("--ray-port", type=int, default=6379)
    p.add_argument("--ray-client-server-port", type=int, default=10001)
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (off by default)")
    p.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard bind address")
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--ray-start-arg", action="append", default=[], metavar="ARG",
                   help="extra `ray start` option, e.g. --ray-start-arg=--object-store-memory=10000000000")
    p.add_argument("--wait-timeout", type=float, default=None,
                   help="seconds to wait for the resources (default: the recipe's ray.resource_wait_timeout_s)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra #SBATCH option, e.g. --sbatch-arg=--qos=high")
    p.add_argument("--command", default=None,
                   help="run this instead of the trainer (shell words; Ray's address in $RAY_ADDRESS)")
    p.add_argument("--output", type=Path, default=None, help="script path (default: JOB_DIR/megaflow-RECIPE.sbatch)")
    p.add_argument("--submit", action="store_true", help="submit with sbatch after writing")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for the trainer")
    return p.parse_args(argv)


def job_from_args(args: argparse.Namespace) -> SlurmJob:
    """The :class:`SlurmJob` described by parsed command-line arguments."""
    return SlurmJob(
        recipe=args.recipe, job_dir=args.job_dir.expanduser().resolve(), overrides=tuple(args.overrides),
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node,
        partition=args.partition, account=args.account, time=args.time, job_name=args.job_name,
        image=args.image, container_mounts=tuple(args.container_mount), python=args.python, workdir=args.workdir,
        interface=args.interface, ray_port=args.ray_port, ray_client_server_port=args.ray_client_server_port,
        dashboard=args.dashboard, dashboard_host=args.dashboard_host, dashboard_port=args.dashboard_port,
        ray_start_args=tuple(args.ray_start_arg), wait_timeout_s=args.wait_timeout,
        sbatch_args=tuple(args.sbatch_arg), command=tuple(shlex.split(args.command)) if args.command else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megaflow.config import ConfigError

    job = job_from_args(args)
    try:
        cfg = load_job_config(job)
        required = launch_requirements(cfg)
        for warning in check_job(job, required):
            print(f"warning: {warning}", file=sys.stderr)
        script = write_sbatch(job, args.output, cfg)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"recipe {job.recipe!r} needs {required.describe()}")
    for line in required.describe_pools():
        print(f"  {line}")
    print(f"wrote {script}")
    if args.submit:
        try:
            job_id = submit(script)
        except (SlurmSubmitError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"submitted job {job_id}; log: {job.job_dir}/slurm-{job_id}.out")
    else:
        print(f"submit with: sbatch {script}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
