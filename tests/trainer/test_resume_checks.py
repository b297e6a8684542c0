"""``trainer.resume`` refusals through ``megaflow.trainer.main``, before Ray starts.

The checkpoints are written with the trainer's own writers (manager, trainer state, the
config YAML, the engine's layout.json), without any worker process.
"""
import json

import pytest
import torch

from megaflow.config import dump_config
from megaflow.topology import load_run
from megaflow.trainer.checkpoint import CheckpointManager, write_trainer_state
from megaflow.trainer.main import main
from megaflow.trainer.ppo_trainer import capture_rng_state

RECIPE = "tiny_arith_grpo"


def _args(tmp_path, *extra):
    return ["--recipe", RECIPE, f"trainer.output_dir={tmp_path}", "trainer.experiment_name=r",
            "trainer.total_steps=6", *extra]


def _checkpoint(tmp_path, step=3, saved_overrides=(), layout=None):
    """A complete checkpoint of run ``r`` at ``step``, saved with ``saved_overrides``."""
    cfg = load_run(RECIPE, [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=r",
                            "trainer.total_steps=6", *saved_overrides])
    mgr = CheckpointManager(tmp_path / "megaflow" / "r" / "checkpoints")
    pending = mgr.begin(step)
    (pending.path / "actor").mkdir()
    (pending.path / "actor" / "layout.json").write_text(json.dumps(
        layout or {"tp": cfg.actor.tp, "pp": cfg.actor.pp, "cp": cfg.actor.cp, "dp": 1, "vpp": cfg.actor.vpp,
                   "world_size": 2}))
    rng, tensors = capture_rng_state()
    write_trainer_state(pending.path, {"global_step": step, "kl_ctrl": {"value": 0.0}, "train_loader": {},
                                       "rng": rng}, tensors)
    (pending.path / "config.yaml").write_text(dump_config(cfg))
    return mgr.commit(pending)


def _run(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("value", ["autoo", "/no/such/checkpoint"])
def test_bad_resume_value_is_refused_at_load(tmp_path, capsys, value):
    code, err = _run(_args(tmp_path, f"trainer.resume={value}"), capsys)
    assert code == 2 and "trainer.resume" in err and "neither 'auto', 'disable' nor an existing" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "megaflow" / "r" / "checkpoints").exists()


def test_config_difference_names_the_keys(tmp_path, capsys):
    _checkpoint(tmp_path, saved_overrides=["actor.optim.lr=0.002"])
    code, err = _run(_args(tmp_path), capsys)
    assert code == 2, err
    assert "actor.optim.lr: 0.002 in the checkpoint, 0.001 now" in err and "resume_ignore_config_diff" in err, err


def test_layout_change_names_the_sizes(tmp_path, capsys):
    _checkpoint(tmp_path, layout={"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": None, "world_size": 2})
    code, err = _run(_args(tmp_path), capsys)
    assert code == 2 and "actor: tp 1 -> 2 (dp 2 -> 1)" in err, err


def test_finished_run_says_so(tmp_path, capsys):
    _checkpoint(tmp_path, step=6)
    code, err = _run(_args(tmp_path, "trainer.resume_ignore_config_diff=true"), capsys)
    assert code == 2 and "this run already finished" in err and "step 6" in err, err


def test_corrupt_checkpoint_is_refused_naming_the_file(tmp_path, capsys):
    path = _checkpoint(tmp_path)
    state = path / "rng_state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x10
    state.write_bytes(bytes(data))
    code, err = _run(_args(tmp_path), capsys)
    assert code == 2 and "rng_state.pt is corrupt" in err, err


def test_partial_save_removed_at_start(tmp_path):
    """A crashed save's .incomplete- directory goes when the next run starts (before Ray)."""
    good = _checkpoint(tmp_path)
    mgr = CheckpointManager(good.parent)
    partial = mgr.begin(4).path
    torch.save({"x": torch.zeros(1)}, partial / "half.pt")
    assert mgr.remove_partials() == [partial] and mgr.latest() == good


def test_expert_parallel_change_names_the_size(tmp_path, capsys):
    # optimizer state of the experts is sharded per EP rank: a checkpoint saved at ep=2 is refused at ep=1,
    # and a layout.json without "ep" (written before expert parallelism) counts as ep=1 and resumes
    _checkpoint(tmp_path, layout={"tp": 2, "pp": 1, "cp": 1, "dp": 1, "vpp": None, "ep": 2, "world_size": 2})
    code, err = _run(_args(tmp_path), capsys)
    assert code == 2 and "actor: ep 2 -> 1" in err and "tp/pp/cp/vpp/ep" in err, err
