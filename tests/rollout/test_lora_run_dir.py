"""The adapter sync's run directory (megaflow.rollout.lora_sync): named by its owner's pid, removed on every exit a
process can handle (close, a ``with`` block left by an exception, interpreter exit), and, after a SIGKILL, by the
next AdapterSync on the machine, which never touches a live process's directory. No engine (the directory is made
before the first sync). The Ray worker's shutdown path is in tests/workers/test_lora_weight_sync.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megaflow.rollout.lora_sync import AdapterSync, remove_stale_run_dirs

# A process that makes an AdapterSync under argv[1], leaves an adapter half-loaded in it, prints the directory and
# returns without closing it (interpreter exit).
EXITING = """
import sys
from types import SimpleNamespace
from megaflow.rollout.lora_sync import AdapterSync
engine = SimpleNamespace(config=SimpleNamespace(max_lora_rank=8, max_lora_versions=2))
sync = AdapterSync(engine, SimpleNamespace(), alpha=8.0, base_model="b", root=sys.argv[1])
(sync.directory / "v3").mkdir()
print(sync.directory, flush=True)
"""
# A process that makes a run directory named as AdapterSync names its own (without importing torch: fast), leaves an
# adapter half-written in it and kills itself with SIGKILL (nothing of its own runs).
KILLED = """
import os, signal, sys, tempfile
from megaflow.launch.watchdog import temp_prefix
path = tempfile.mkdtemp(prefix=temp_prefix("lora"), dir=sys.argv[1])
os.mkdir(os.path.join(path, "v3"))
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _engine() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(max_lora_rank=8, max_lora_versions=2))


def _child(script: str, root: Path) -> tuple[Path, int]:
    """Run ``script`` with ``root`` to its end; the directory it printed and its pid (dead and reaped on return)."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == (-9 if script is KILLED else 0), out
    return Path(out.strip()), proc.pid


def test_the_run_directory_goes_with_close_and_with_an_exception(tmp_path):
    sync = AdapterSync(_engine(), SimpleNamespace(), alpha=8.0, base_model="b", root=tmp_path)
    assert sync.directory.parent == tmp_path and sync.directory.name.startswith(f"megaflow-lora-{os.getpid()}-")
    assert oct(sync.directory.stat().st_mode & 0o777) == "0o700"
    sync.close()
    sync.close()  # idempotent
    assert not sync.directory.exists()
    with pytest.raises(RuntimeError, match="step failed"):
        with AdapterSync(_engine(), SimpleNamespace(), alpha=8.0, base_model="b", root=tmp_path) as sync:
            (sync.directory / "v0").mkdir()
            raise RuntimeError("step failed")
    assert list(tmp_path.iterdir()) == []


def test_a_killed_process_leaves_its_directory_to_the_next_sync_which_spares_live_ones(tmp_path):
    exited, _ = _child(EXITING, tmp_path)
    assert exited.parent == tmp_path and not exited.exists()  # interpreter exit: atexit removed it
    killed, pid = _child(KILLED, tmp_path)
    assert killed.name.startswith(f"megaflow-lora-{pid}-") and (killed / "v3").is_dir()
    live = tmp_path / f"megaflow-lora-{os.getppid()}-concurrent"  # a live process's (a concurrent run's)
    unknown = tmp_path / "megaflow-lora-k2j4h5g6"  # no pid in the name: its owner cannot be told
    other = tmp_path / f"megaflow-task-{pid}-x"  # another kind of megaflow directory
    for path in (live, unknown, other):
        path.mkdir()
    with AdapterSync(_engine(), SimpleNamespace(), alpha=8.0, base_model="b", root=tmp_path) as sync:
        assert sorted(tmp_path.iterdir()) == sorted([live, unknown, other, sync.directory])
    assert remove_stale_run_dirs(tmp_path) == []  # nothing else is stale
    assert remove_stale_run_dirs(tmp_path / "missing") == []
