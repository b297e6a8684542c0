"""Atomic checkpoints: published only when complete, partial saves never picked up."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megaflow.trainer.checkpoint import COMPLETE_MARKER, CheckpointManager


def _save(mgr, step, payload="x"):
    pending = mgr.begin(step)
    (pending.path / "actor").mkdir()
    (pending.path / "actor" / "weights.bin").write_text(payload)
    (pending.path / "trainer_state.pt").write_text(str(step))
    return mgr.commit(pending, required_parts=("actor", "trainer_state.pt"))


def test_commit_publishes_and_latest_tracks(tmp_path):
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() is None and mgr.resolve("auto") is None
    p1 = _save(mgr, 10)
    p2 = _save(mgr, 20)
    assert p1.name == "global_step_10" and (p1 / COMPLETE_MARKER).is_file()
    assert mgr.latest() == p2 and mgr.resolve("auto") == p2
    assert (tmp_path / "latest").read_text().strip() == "global_step_20"
    assert mgr.resolve("disable") is None
    assert mgr.resolve(str(p1)) == p1


def test_partial_checkpoint_is_never_resumed(tmp_path):
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 5)
    pending = mgr.begin(6)
    (pending.path / "actor").mkdir()  # crash before commit: no COMPLETE, partial name
    assert mgr.latest() == good
    with pytest.raises(FileNotFoundError, match="lacks parts \\['trainer_state.pt'\\]"):
        mgr.commit(pending, required_parts=("actor", "trainer_state.pt"))
    assert mgr.latest() == good
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        mgr.resolve(str(pending.path))


def test_keep_last_prunes_old_complete_only(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for s in (1, 2, 3):
        _save(mgr, s)
    assert [s for s, _ in mgr.complete_checkpoints()] == [2, 3]
    with pytest.raises(ValueError, match=r"trainer.max_ckpt_to_keep must be >= 1 or null, got 0"):
        CheckpointManager(tmp_path, keep_last=0)


def test_process_killed_mid_save_leaves_previous_intact(tmp_path):
    """A real SIGKILL while the part files are being written."""
    mgr = CheckpointManager(tmp_path)
    good = _save(mgr, 1, payload="old")
    script = textwrap.dedent(f"""
        import time
        from megaflow.trainer.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        p = mgr.begin(2)
        with open(p.path / "trainer_state.pt", "w") as f:
            f.write("half")
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
        mgr.commit(p)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert mgr.latest() == good
    assert (good / "actor" / "weights.bin").read_text() == "old"
    partial = [p.name for p in tmp_path.iterdir() if ".incomplete-" in p.name]
    assert len(partial) == 1 and partial[0].startswith(".global_step_2.incomplete-")
    assert mgr.remove_partials() == [tmp_path / partial[0]] and mgr.latest() == good
