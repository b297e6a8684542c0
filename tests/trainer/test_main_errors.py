"""`make train` input errors: one line naming the key or file, exit code 2, no processes started."""
import pytest

from megaflow.trainer.main import main


@pytest.mark.parametrize("overrides,expected", [
    (["actor.lrr=1"], "actor.lrr: unknown key"),
    (["trainer.total_steps=abc"], "trainer.total_steps: expected int"),
    (["actor.tp=3"], "actor.tp:"),
    (["data.task=null", "data.train_files=[/nonexistent.parquet]"],
     "data.train_files / data.val_files: prompt dataset file not found: /nonexistent.parquet"),
])
def test_bad_input_exits_2_with_the_key(overrides, expected, tmp_path, capsys):
    rc = main(["--recipe", "tiny_arith_grpo", f"trainer.output_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and expected in err, err
