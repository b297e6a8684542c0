"""A real single-node Slurm cluster on localhost for tests: munged, slurmctld, slurmd.

Debian's ``slurm-wlm`` and ``munge`` packages provide the binaries
(``apt-get install -y --no-install-recommends slurm-wlm munge``). Everything else lives
in one directory: a fresh munge key and socket, ``slurm.conf`` with free ports, state,
spool and logs. The daemons run in the foreground as children of the test process
(no systemd, no cgroups: ``proctrack/linuxproc``, ``task/none``) and are stopped by
:meth:`LocalSlurm.stop`. Client commands find the cluster through ``SLURM_CONF`` in
:attr:`LocalSlurm.env`, so nothing leaks into other tests.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from megaflow.utils.launch import find_free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
NODE = "localhost"


def missing_binaries() -> list[str]:
    """Slurm/munge programs not on PATH (``/usr/sbin`` included)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


SLURM_CONF = """\
ClusterName=megaflowtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """munged + slurmctld + slurmd for one node named ``localhost`` with ``cpus`` CPUs.

    Args:
        root: empty directory for keys, config, state and logs.
        cpus: CPUs the node advertises (``config_overrides``: not checked against hardware).
    """

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.cpus = Path(root), cpus
        self.env = dict(os.environ, SLURM_CONF=str(self.root / "slurm.conf"),
                        PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        for key in [k for k in self.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del self.env[key]  # never inherit an outer allocation's variables
        self._procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the three daemons and wait until the node is idle.

        Raises:
            RuntimeError: a daemon exited or the node did not become idle (log tails attached).
        """
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        (self.root / "slurm.conf").write_text(SLURM_CONF.format(
            node=NODE, root=self.root, cpus=self.cpus, ctld_port=find_free_port(), slurmd_port=find_free_port()))
        munge = self.root / "munge"
        self._spawn(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge}/munge.sock",
                     f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed",
                     f"--log-file={self.root}/log/munged.log"], "munged")
        self._wait(lambda: (munge / "munge.sock").exists(), timeout_s, "munged did not create its socket")
        conf = str(self.root / "slurm.conf")
        self._spawn(["slurmctld", "-D", "-i", "-f", conf], "slurmctld")
        self._wait(lambda: self._run(["scontrol", "ping"]).returncode == 0, timeout_s, "slurmctld did not answer")
        self._spawn(["slurmd", "-D", "-N", NODE, "-f", conf], "slurmd")
        self._wait(lambda: self.node_state().startswith("IDLE"), timeout_s, "the node did not become idle")

    def _spawn(self, cmd: list[str], name: str) -> None:
        out = open(self.root / "log" / f"{name}.stdout", "wb")
        self._procs.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))
        out.close()

    def _run(self, cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{what}: {', '.join(dead)} exited\n{self.log_tails()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"{what} within {timeout_s:g} s\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every daemon log (for failure messages)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def node_state(self) -> str:
        """``scontrol``'s State of the node (``IDLE``, ``ALLOCATED``, ``DOWN*``...), or ``""``."""
        proc = self._run(["scontrol", "-o", "show", "node", NODE])
        match = re.search(r"\bState=(\S+)", proc.stdout)
        return match.group(1) if match else ""

    def sbatch(self, script: Path) -> int:
        """Submit ``script`` through megaflow's :func:`~megaflow.launch.slurm.submit`; returns the job id.

        Raises:
            SlurmSubmitError: Slurm refused it or can never run it.
        """
        from megaflow.launch.slurm import submit

        return submit(script, env=self.env)

    def queue(self) -> list[int]:
        """Ids of the jobs pending or running (``squeue``)."""
        proc = self._run(["squeue", "-h", "-o", "%i"])
        return [int(line) for line in proc.stdout.split()]

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` fields (JobState, ExitCode, RunTime...)."""
        proc = self._run(["scontrol", "-o", "show", "job", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))

    def wait_job(self, job_id: int, timeout_s: float) -> dict[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING; returns its fields.

        Raises:
            TimeoutError: still not finished after ``timeout_s`` (the job is cancelled).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return info
            time.sleep(1.0)
        self._run(["scancel", str(job_id)])
        raise TimeoutError(f"job {job_id} did not finish within {timeout_s:g} s: {self.job(job_id)}")

    def stop(self) -> None:
        """Stop slurmd, slurmctld and munged (TERM, then KILL after 15 s)."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs = []
