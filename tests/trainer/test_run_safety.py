"""Runs that cannot hurt each other (issue 37): the run directory's lock, what resume says it
took and skipped, paths in a checkpoint's metadata confined to it, nothing left behind by a
refused run or a killed controller (the watchdog). No Ray here; the multi-process runs are in
``test_run_safety_slow.py``."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from megaflow.trainer.checkpoint import CheckpointManager
from megaflow.trainer.main import main
from megaflow.utils.integrity import IntegrityError, check_dcp_pickles, verify_manifest, write_manifest
from megaflow.utils.run_lock import LOCK_FILE, RunDirLock, RunDirLockedError

from test_resume_checks import _args, _checkpoint

REPO = Path(__file__).resolve().parents[2]


def _hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock until it is killed."""
    code = ("import sys, time; from megaflow.utils.run_lock import RunDirLock; "
            "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.delenv("MEGAFLOW_DEBUG", raising=False)
    started = []  # the refusal comes before Ray starts (a suite's shared Ray may already be up)
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append((a, k)))
    good = _checkpoint(tmp_path)
    partial = CheckpointManager(good.parent).begin(4).path  # the holder's save in progress
    holder = _hold_lock(good.parent.parent)
    try:
        assert main(_args(tmp_path)) == 2
        err = capsys.readouterr().err
        assert f"pid {holder.pid}" in err and "is in use by another run" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
        assert partial.is_dir(), "the refused run removed the holder's save in progress"
        assert started == [], "the refused run started Ray"
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": dead.pid, "time": time.time()}))
    said = []
    with RunDirLock(tmp_path, say=said.append) as lock:
        assert lock.held
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
            RunDirLock(tmp_path).acquire()  # another open file description: refused like another process
    assert len(said) == 1 and f"host elsewhere pid {dead.pid}" in said[0] and "took over" in said[0]
    said.clear()
    with RunDirLock(tmp_path, say=said.append):  # a clean release leaves nothing to take over
        pass
    assert said == []


def test_resume_says_what_it_took_and_why_it_skipped_newer_saves(tmp_path, capsys):
    good = _checkpoint(tmp_path, step=3)
    newer = _checkpoint(tmp_path, step=5)
    (newer / "COMPLETE").unlink()
    partial = CheckpointManager(good.parent).begin(6).path
    assert main(["--dry-run", *_args(tmp_path, "trainer.total_steps=8")]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if "resuming from" in ln]
    assert line == [f"[megaflow] resuming from {good} at step 3: the newest complete checkpoint "
                    f"(trainer.resume=auto); skipped newer: global_step_5 (no COMPLETE marker: a damaged or "
                    f"unfinished save), {partial.name} (a save that was interrupted or is still being written)"]


def test_a_resume_refusal_leaves_no_temporary_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    _checkpoint(tmp_path, saved_overrides=["actor.optim.lr=0.5"])
    assert main(_args(tmp_path)) == 2
    assert "actor.optim.lr: 0.5 in the checkpoint" in capsys.readouterr().err
    assert list((tmp_path / "tmp").iterdir()) == []


def _dcp_checkpoint(directory: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(4.0), "extra": {"note": "x"}}, checkpoint_id=str(directory), no_dist=True)
    return directory


def _rewrite_metadata(directory: Path, relative_path: str) -> None:
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)(relative_path, info.offset, info.length,
                                                  *([info.transform_descriptors]
                                                    if hasattr(info, "transform_descriptors") else []))
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("relative", ["../../etc/passwd", "/etc/passwd", "sub/../../outside.distcp", "link.distcp"])
def test_paths_in_dcp_metadata_stay_inside_the_checkpoint(tmp_path, relative):
    ckpt = _dcp_checkpoint(tmp_path / "ckpt")
    check_dcp_pickles(ckpt)  # the untouched checkpoint passes
    (tmp_path / "outside.distcp").write_bytes(b"x" * 4096)
    os.symlink(tmp_path / "outside.distcp", ckpt / "link.distcp")
    _rewrite_metadata(ckpt, relative)
    with pytest.raises(IntegrityError) as err:
        check_dcp_pickles(ckpt)
    assert str(ckpt / ".metadata") in str(err.value) and repr(relative) in str(err.value)
    assert "refused" in str(err.value)


def test_paths_in_a_manifest_stay_inside_the_checkpoint(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.bin").write_bytes(b"1")
    manifest = write_manifest(tmp_path / "c")
    assert verify_manifest(tmp_path / "c") == 1
    manifest["files"]["../../etc/passwd"] = manifest["files"]["a.bin"]
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match=r"entry '../../etc/passwd'.*leads outside the checkpoint directory"):
        verify_manifest(tmp_path / "c")


_CONTROLLER = """
import os, subprocess, sys, tempfile, time
from megaflow.launch.watchdog import Watchdog, temp_prefix
dog = Watchdog.start()
root = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300"], start_new_session=True)
tmp = tempfile.mkdtemp(prefix=temp_prefix("task"))
dog.track([root.pid])
print(root.pid, tmp, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("root_dies_first", [False, True])
def test_the_watchdog_cleans_up_after_a_killed_controller(tmp_path, root_dies_first):
    controller = subprocess.Popen([sys.executable, "-c", _CONTROLLER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    root_pid, tmp = controller.stdout.readline().split()
    root = psutil.Process(int(root_pid))
    deadline = time.monotonic() + 30
    while len(root.children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = [root, *root.children(recursive=True)]
    assert len(tree) >= 2 and Path(tmp).is_dir()
    time.sleep(5.0)  # the watchdog snapshots the tree every POLL_S; room for a loaded machine to schedule it
    if root_dies_first:  # as Ray's raylet dies with the driver and leaves its agents re-parented
        root.kill()  # a zombie of the controller until the controller is gone
        time.sleep(1.5)
    controller.kill()
    controller.wait()
    _, alive = psutil.wait_procs(tree, timeout=20)
    assert not alive, [(p.pid, p.name()) for p in alive]
    deadline = time.monotonic() + 10
    while Path(tmp).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(tmp).exists()
