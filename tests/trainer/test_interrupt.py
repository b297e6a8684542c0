"""Ctrl-C during training: one line saying where the run stopped and how to resume, exit 130,
no traceback, and Ray's processes stop with the controller."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def _steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]


def test_ctrl_c_stops_with_one_line_and_exit_130(tmp_path):
    run_dir = tmp_path / "megaflow" / "ctrlc"
    cmd = [sys.executable, "-m", "megaflow.trainer.main", "--recipe", "tiny_arith_grpo",
           f"trainer.output_dir={tmp_path}", "trainer.experiment_name=ctrlc", "trainer.total_steps=50",
           "trainer.save_freq=1", "trainer.test_freq=0", "trainer.logger=[jsonl]"]
    # A session of its own: the signal goes to the whole process group, as a terminal's Ctrl-C does.
    # SIGINT handled as in a terminal's foreground job: a suite started in the background by a
    # non-interactive shell (`make test &`, nohup) inherits SIGINT ignored, and so would the run.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 900
    while not (run_dir / "checkpoints" / "global_step_1" / "COMPLETE").is_file():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not save step 1"
        time.sleep(0.5)
    helpers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("megaflow: ")]
    assert len(lines) == 1 and lines[0].startswith("megaflow: interrupted after step "), stderr[-3000:]
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert step >= 1 and "global_step_" in lines[0] and "trainer.resume=auto" in lines[0], lines[0]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    _, alive = psutil.wait_procs(helpers, timeout=20)
    assert not alive, [(p.pid, p.name()) for p in alive]
