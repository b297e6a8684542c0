"""``make train`` / ``make slurm`` hand every override to Python as one argument, exactly as
typed, and never let a shell or make evaluate it (issue 37 item 1, issue 36 item 6).

Each command line is typed through ``bash -c`` (the user's shell) into make. ``make -n``
shows the command make would run; the real forwarding path runs with ``VENV`` pointed at a
stand-in "python" that only writes its arguments to a file, so nothing heavy starts. A
canary file in the working directory tells whether any word ran as a command.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: One word per key; each would run ``touch CANARY`` if a shell evaluated it.
HOSTILE = [
    "trainer.experiment_name=x;touch CANARY",
    "trainer.project_name=a b  c",
    "a.b=$(touch CANARY)",
    "a.c=`touch CANARY`",
    "a.d=it's \"quoted\"",
    "a.e=<in >out | touch CANARY &",
    "a.f=$HOME $$ $(shell touch CANARY) back\\slash \\ tail\\",
    "reward.reward_kwargs.openai/gsm8k.method=flexible",
    'reward.reward_kwargs={"openai/gsm8k": {"method": "flexible"}}',
    'reward.reward_kwargs."my.source".method=strict',
    "reward.format_pattern=^<think>.*?</think>\\s*<answer>(.*)</answer><\\|im_end\\|>$",
]


def _bash_make(words: list[str], cwd: Path, *, dry: bool = True, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    line = " ".join(shlex.quote(w) for w in ["make", "-C", str(REPO), "--no-print-directory",
                                               *(["-n"] if dry else []), *words])
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def _forwarded(stdout: str, module: str) -> list[str]:
    line = [ln for ln in stdout.splitlines() if f"-m {module}" in ln][-1]
    return shlex.split(line)[3:]


@pytest.fixture
def stand_in_venv(tmp_path):
    """A VENV whose bin/python writes its argv (JSON) to $ARGV_OUT, marked installed."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexec python3 -c 'import json, os, sys; "
                      "open(os.environ[\"ARGV_OUT\"], \"w\").write(json.dumps(sys.argv[1:]))' \"$@\"\n")
    python.chmod(0o755)
    (venv / ".megaflow-installed").touch()  # newer than setup.py and the Makefile: install is skipped
    return venv


@pytest.mark.parametrize("target, module", [("train", "megaflow.trainer.main"), ("slurm", "megaflow.launch.slurm")])
def test_hostile_words_reach_python_intact_through_make_n(target, module, tmp_path):
    proc = _bash_make([target, "RECIPE=tiny_arith_grpo;touch CANARY", *HOSTILE], tmp_path)
    assert proc.returncode == 0, proc.stderr
    args = _forwarded(proc.stdout, module)
    assert args == ["--recipe", "tiny_arith_grpo;touch CANARY", *HOSTILE]
    assert not (tmp_path / "CANARY").exists()


def test_hostile_words_reach_python_intact_when_make_runs(stand_in_venv, tmp_path):
    out = tmp_path / "argv.json"
    for target, extra in (("train", ["DRY_RUN=yes"]), ("slurm", ["SLURM_ARGS=--job-dir /x;touch CANARY --submit"])):
        proc = _bash_make([target, f"VENV={stand_in_venv}", "RECIPE=r;touch CANARY", *extra, *HOSTILE],
                          tmp_path, dry=False, env={"ARGV_OUT": str(out)})
        assert proc.returncode == 0, proc.stderr
        argv = json.loads(out.read_text())
        module = "megaflow.trainer.main" if target == "train" else "megaflow.launch.slurm"
        flags = ["--dry-run"] if target == "train" else ["--job-dir", "/x;touch", "CANARY", "--submit"]
        assert argv == ["-m", module, "--recipe", "r;touch CANARY", *flags, *HOSTILE]
        assert not (tmp_path / "CANARY").exists()


def test_make_knobs_are_never_expanded(tmp_path):
    # A knob's value is used as typed; `$(shell ...)` in it is text, not a command.
    proc = _bash_make(["train", "RECIPE=$(shell touch CANARY)", "trainer.total_steps=3"], tmp_path)
    assert proc.returncode == 0 and not (tmp_path / "CANARY").exists(), proc.stderr
    assert _forwarded(proc.stdout, "megaflow.trainer.main")[:2] == ["--recipe", "$(shell touch CANARY)"]


@pytest.mark.parametrize("spelling, dry", [
    ("1", True), ("true", True), ("True", True), ("TRUE", True), ("yes", True), ("Yes", True), ("on", True),
    ("ON", True), ("0", False), ("false", False), ("False", False), ("no", False), ("NO", False), ("off", False),
    ("", False),
])
def test_dry_run_spellings(spelling, dry, tmp_path):
    proc = _bash_make(["train", f"DRY_RUN={spelling}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("--dry-run" in _forwarded(proc.stdout, "megaflow.trainer.main")) is dry


@pytest.mark.parametrize("spelling", ["2", "maybe", "y", "tru", "1 ; touch CANARY", "$(shell touch CANARY)"])
def test_other_dry_run_values_are_refused_before_anything_runs(spelling, tmp_path):
    proc = _bash_make(["train", f"DRY_RUN={spelling}"], tmp_path)
    assert proc.returncode != 0 and "megaflow.trainer.main" not in proc.stdout
    assert f"DRY_RUN='{spelling}' is not a yes/no value" in proc.stderr
    assert not (tmp_path / "CANARY").exists()


@pytest.mark.parametrize("word, named", [
    ("total_steps=a b", "cannot forward 'total_steps=a b' to the trainer"),
    ("x.y=line\nbreak", "holding a newline or a control character"),
])
def test_words_make_cannot_forward_are_refused_by_name(word, named, tmp_path):
    proc = _bash_make(["train", word], tmp_path)
    assert proc.returncode != 0 and "megaflow.trainer.main" not in proc.stdout
    assert named in proc.stderr


@pytest.mark.parametrize("word, expected", [
    ("reward.reward_kwargs.openai/gsm8k.method=flexible", {"openai/gsm8k": {"method": "flexible"}}),
    ('reward.reward_kwargs={"openai/gsm8k": {"method": "flexible"}}', {"openai/gsm8k": {"method": "flexible"}}),
    ("reward.reward_kwargs={openai/gsm8k: {method: flexible}}", {"openai/gsm8k": {"method": "flexible"}}),
    ('reward.reward_kwargs."my.source".method=flexible',
     {"openai/gsm8k": {"method": "strict"}, "my.source": {"method": "flexible"}}),
])
def test_mapping_keys_with_slash_and_dot_load_through_bash_and_make(word, expected, tmp_path):
    from megaflow.config import load_config

    proc = _bash_make(["train", "RECIPE=smollm2_gsm8k_grpo", word], tmp_path)
    assert proc.returncode == 0, proc.stderr
    args = _forwarded(proc.stdout, "megaflow.trainer.main")
    cfg = load_config(args[1], args[2:])
    assert {k: dict(v) for k, v in cfg.reward.reward_kwargs.items()} == expected


@pytest.mark.parametrize("word, message", [
    ("reward.reward_kwargs={openai/gsm8k: {method:flexible}}",
     "reward.reward_kwargs: mapping entry 'method:flexible' has no value; write 'method: flexible'"),
    ("reward.reward_kwargs={openai/gsm8k: {method: flexible}", "reward.reward_kwargs: override value"),
    ('reward.reward_kwargs."my.source.method=x', "expected key.sub=value"),
])
def test_a_mangled_mapping_is_refused_naming_the_key(word, message, tmp_path, capsys, monkeypatch):
    from megaflow.trainer.main import main

    monkeypatch.delenv("MEGAFLOW_DEBUG", raising=False)
    proc = _bash_make(["train", "RECIPE=smollm2_gsm8k_grpo", word], tmp_path)
    args = _forwarded(proc.stdout, "megaflow.trainer.main")
    assert args[-1] == word
    assert main(["--dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
