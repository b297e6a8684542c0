"""`make train` input errors: one line naming the key or file, exit code 2, no traceback,
no processes started and nothing written; the dry run reports the same errors.

(The README's "Bad input" table is run row by row in tests/test_bad_input_table.py.)"""
import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import main
from megaflow.trainer.preflight import PreflightError, check_local_resources, preflight


@pytest.mark.parametrize("overrides,expected", [
    (["actor.lrr=1"], "actor.lrr: unknown key"),
    (["trainer.total_steps=abc"], "trainer.total_steps: expected int"),
    (["actor.tp=3"], "actor.tp:"),
    (["data.task=null", "data.train_files=[/nonexistent.parquet]"],
     "data.train_files: prompt dataset file not found: /nonexistent.parquet"),
])
def test_bad_input_exits_2_with_the_key(overrides, expected, tmp_path, capsys):
    rc = main(["--recipe", "tiny_arith_grpo", f"trainer.output_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and expected in err, err
    assert "Traceback" not in err and not (tmp_path / "megaflow").exists()


def test_dry_run_reports_every_problem_after_the_plan(tmp_path, capsys):
    rc = main(["--recipe", "tiny_arith_grpo", "--dry-run", f"trainer.output_dir={tmp_path}",
               "rollout.response_length=60", "data.task_args.num_trainn=5", "model.tokenizer=/nonexistent"])
    out, err = capsys.readouterr()
    assert rc == 2 and "megaflow dry run: tiny_arith_grpo" in out
    lines = [line for line in err.splitlines() if line.startswith("megaflow: config error: ")]
    keys = [line.split(": ")[2] for line in lines]
    assert keys == ["rollout.response_length", "data.task_args.num_trainn", "model.tokenizer"], err


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAFLOW_DEBUG", "1")
    with pytest.raises(PreflightError, match="model.tokenizer: tokenizer '/nonexistent' does not exist"):
        main(["--recipe", "tiny_arith_grpo", f"trainer.output_dir={tmp_path}", "model.tokenizer=/nonexistent"])


def test_preflight_loads_the_data_without_creating_the_run_dir(tmp_path):
    cfg = load_run("tiny_arith_grpo", [f"trainer.output_dir={tmp_path}", "data.task_args.num_train=40"])
    inputs = preflight(cfg)
    try:
        assert len(inputs.train_dataset) == 40 and inputs.val_dataset is not None
        assert not (tmp_path / "megaflow").exists()
        dest = tmp_path / "run" / "data"
        inputs.keep_generated(dest)
        assert sorted(p.name for p in dest.iterdir()) == ["train.parquet", "val.parquet"]
    finally:
        inputs.discard_generated()


def test_dry_run_leaves_no_generated_files(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert main(["--recipe", "tiny_arith_grpo", "--dry-run", f"trainer.output_dir={tmp_path / 'out'}"]) == 0
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, cpus, gpus, key", [
    ([], 1, 0, "resources.num_cpus_per_proc"),          # 2 ranks x 1 CPU on a 1-CPU machine
    (["resources.num_cpus_per_proc=2"], 3, 0, "resources.num_cpus_per_proc"),
    (["ray.num_cpus=3", "resources.num_cpus_per_proc=2"], 64, 0, "ray.num_cpus"),
    (["resources.use_gpu=true"], 64, 0, "resources.use_gpu"),
    (["resources.use_gpu=true"], 64, 1, "resources.procs_per_node"),
])
def test_local_resources_that_ray_would_wait_for_forever(overrides, cpus, gpus, key):
    cfg = load_run("tiny_arith_grpo", overrides)
    with pytest.raises(Exception) as err:
        check_local_resources(cfg, cpu_count=cpus, gpu_count=gpus)
    assert str(err.value).startswith(f"{key}: "), err.value


def test_local_resources_that_fit_pass():
    check_local_resources(load_run("tiny_arith_grpo"), cpu_count=2, gpu_count=0)
    check_local_resources(load_run("tiny_arith_grpo", ["resources.use_gpu=true"]), cpu_count=2, gpu_count=2)
    # a cluster run is checked against the cluster when it connects (bounded wait), not here
    check_local_resources(load_run("tiny_arith_grpo", ["resources.nodes=4", "ray.address=10.0.0.1:6379"]),
                          cpu_count=1, gpu_count=0)


def test_a_local_ray_that_does_not_start_is_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    """Ray's own start-up timeout (a bare ``Exception`` from ``ray.init`` on an overloaded
    machine) ends the run with one line, exit 3 and Ray's half-started processes stopped."""
    import ray

    shutdowns = []

    def timed_out(*args, **kwargs):
        raise Exception("The current node timed out during startup. This could happen because some "
                        "of the raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # also beside another test's Ray session
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    rc = main(["--recipe", "tiny_arith_grpo", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megaflow:")]
    assert rc == 3 and "Traceback" not in err, err
    assert lines == ["megaflow: the local Ray did not start: The current node timed out during startup. "
                     "This could happen because some of the raylet failed to startup or the GCS has become "
                     "overloaded. (a busy or memory-short machine is the usual cause; Ray's own logs are "
                     "under /tmp/ray/session_latest/logs); nothing was trained, start the run again"], err
    assert shutdowns, "ray.shutdown() was not called after the failed start"
