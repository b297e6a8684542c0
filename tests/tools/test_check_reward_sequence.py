"""tools/check_reward_sequence.py: the exact comparison and its refusals (the full check,
two training runs, is what the tool itself does; README's "Tests and development")."""
import json
import math

import pytest

from toolslib import load_tool

tool = load_tool("check_reward_sequence")


def test_first_difference_is_exact_and_names_the_step():
    base = {1: 0.25, 2: 0.1 + 0.2, 3: 0.5}
    assert tool.first_difference(base, dict(base), 3) is None
    # one ulp apart is a difference: no tolerance
    nudged = {**base, 2: math.nextafter(base[2], 1.0)}
    assert tool.first_difference(base, nudged, 3) == (2, base[2], nudged[2])
    assert tool.first_difference(base, {1: 0.25, 2: base[2]}, 3) == (3, 0.5, None)  # a missing step
    assert tool.first_difference({1: math.nan}, {1: math.nan}, 1) is None


def test_reward_sequence_reads_the_score_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "critic/score/mean": 0.125}, {"step": 2, "actor/pg_loss": 1.0},
               {"step": 2, "critic/score/mean": 0.375}]  # a resumed run appends records of a step
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert tool.reward_sequence(path) == {1: 0.125, 2: 0.375}


def test_bad_arguments_are_refused_before_any_run(capsys):
    assert tool.main(["--base", "no-such-revision-xyz"]) == 2
    assert "--base 'no-such-revision-xyz' is not a commit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tool.main(["--steps", "0"])
    assert exc.value.code == 2
