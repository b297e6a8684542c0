"""The README's "Bad input" table, row by row: each input is refused before any process
starts with exit code 2, no traceback, and a message containing the table's text.

Rows are read from README.md, so the table and the behaviour cannot drift apart. An
input starting with ``make train`` runs through the Makefile's checks (``make -n``, which
prints the trainer command instead of running it) and then through the trainer's
``main()`` in-process on the default recipe, and again as a dry run, which must exit with the
same code and the same lines; ``tools/...`` rows run the tool's ``main``.
``<...>`` placeholders are built here (see ``FIXTURES``).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `(?P<input>[^`]+)`(?P<note>[^|]*)\| `(?P<message>.+)` \|$")


def table_rows() -> list[tuple[str, str, str]]:
    """``(input, note, expected message)`` of every row of README's "Bad input" table."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `")]
    assert rows and all(rows), "a row of the Bad input table does not parse"
    return [(m["input"], m["note"].strip(), m["message"]) for m in rows]


def _tiny_model_dir(path: Path) -> Path:
    """A random 2-layer Llama in HF format whose vocabulary is the arith tokenizer's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=0, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _edit_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit(dst / "model.safetensors")
    return dst


def _drop_tensor(file: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})


def _null_ground_truth(tmp: Path) -> str:
    path = tmp / "null_gt.jsonl"
    row = {"data_source": "arith", "prompt": [{"role": "user", "content": "1+2="}],
           "reward_model": {"style": "rule", "ground_truth": None}}
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def _recipe_with(tmp: Path, name: str, old: str, new: str) -> str:
    """The default recipe with its first ``old`` text replaced by ``new``."""
    text = (REPO / "recipes/tiny_arith_grpo.yaml").read_text()
    assert old in text
    path = tmp / f"{name}.yaml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


def _corrupt_checkpoint(tmp: Path) -> str:
    ckpt = tmp / "ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "megaflow_checkpoint.json").write_text('{"format": "megaflow"')
    (ckpt / "COMPLETE").write_text("{}")
    return str(ckpt)


#: Module name of the scorers built for the ``<scorer module>`` rows (in the test's tmp dir).
SCORERS = "megaflow_bad_scorers"
_SCORERS_SOURCE = """
import math


def raises(response, ground_truth, extra_info=None):
    raise ValueError("always")


def two_arguments(response, ground_truth):
    return 1.0


def nan(response, ground_truth, extra_info=None):
    return math.nan


def text(response, ground_truth, extra_info=None):
    return "right"
"""


def _scorer_module(tmp: Path) -> str:
    """A module of broken reward functions, importable because the test puts ``tmp`` on sys.path."""
    (tmp / f"{SCORERS}.py").write_text(_SCORERS_SOURCE)
    return SCORERS


def _with_config(src: Path, dst: Path, text: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(text)
    return dst


def _more_heads(src: Path) -> str:
    config = json.loads((src / "config.json").read_text())
    return json.dumps({**config, "num_attention_heads": 8, "num_key_value_heads": 4})


def _int32_norm(file: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, str(file), metadata={"format": "pt"})


FIXTURES = {
    "<scorer module>": lambda tmp, model: _scorer_module(tmp),
    "<model dir whose config.json is a list>": lambda tmp, model: str(_with_config(model, tmp / "m4", "[1, 2]")),
    "<model dir whose config.json says 8 heads>": lambda tmp, model: str(_with_config(model, tmp / "m5",
                                                                                      _more_heads(model))),
    "<model dir with int32 norm weights>": lambda tmp, model: str(_edit_weights(model, tmp / "m6", _int32_norm)),
    "<300 characters>": lambda tmp, model: "x" * 300,
    "<recipe with a second lr: under actor.optim>":
        lambda tmp, model: _recipe_with(tmp, "dup_lr", "    lr: 1.0e-3\n", "    lr: 1.0e-3\n    lr: 2.0e-3\n"),
    "<recipe with a second trainer: block>":
        lambda tmp, model: _recipe_with(tmp, "dup_trainer", "\nresources:", "\ntrainer:\n  total_steps: 5\n\nresources:"),
    "<model dir without one tensor>": lambda tmp, model: str(_edit_weights(model, tmp / "m1", _drop_tensor)),
    "<model dir with a truncated model.safetensors>": lambda tmp, model: str(_edit_weights(
        model, tmp / "m2", lambda f: f.write_bytes(f.read_bytes()[:200]))),
    "<model dir without weights>": lambda tmp, model: str(_edit_weights(model, tmp / "m3", Path.unlink)),
    "<rows with a null ground truth>": lambda tmp, model: _null_ground_truth(tmp),
    "<new dir>": lambda tmp, model: str(tmp / "new_out"),
    "<model dir>": lambda tmp, model: str(model),
    "<checkpoint with a corrupt megaflow_checkpoint.json>": lambda tmp, model: _corrupt_checkpoint(tmp),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")


def _resolve(text: str, tmp: Path, model: Path) -> str:
    for placeholder, build in FIXTURES.items():
        if placeholder in text:
            text = text.replace(placeholder, build(tmp, model))
    assert "<" not in text, f"no fixture for a placeholder in {text!r}"
    return text


def _run_make(words: list[str], tmp: Path) -> tuple[int, str, list[str] | None]:
    """``make -n train WORDS``: (exit code, stderr, trainer arguments it would run or None)."""
    proc = subprocess.run(["make", "-n", "--no-print-directory", *words], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        return proc.returncode, proc.stderr, None
    line = [ln for ln in proc.stdout.splitlines() if "megaflow.trainer.main" in ln][-1]
    return 0, proc.stderr, shlex.split(line.split("megaflow.trainer.main", 1)[1])


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_gpu() -> bool:
    import torch

    return torch.cuda.device_count() > 0


def _dashboard_installed() -> bool:
    from ray._private.utils import get_dashboard_dependency_error

    return get_dashboard_dependency_error() is None


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


#: A row's note -> whether this machine lacks what the row needs (the row is then skipped).
ENVIRONMENT_NOTES = {
    "(no GPU)": _has_gpu,
    "(without wandb)": lambda: importlib.util.find_spec("wandb") is not None,
    "(without ray[default])": _dashboard_installed,
    "(port 1 closed)": lambda: _accepts_connections("127.0.0.1", 1),
}


@pytest.mark.parametrize("command, note, expected", table_rows(), ids=[r[0] for r in table_rows()])
def test_bad_input_row(command, note, expected, tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.delenv("MEGAFLOW_DEBUG", raising=False)
    for condition, present in ENVIRONMENT_NOTES.items():
        if condition in note and present():
            pytest.skip(f"this machine does not fit the row's note {condition}")
    monkeypatch.syspath_prepend(str(tmp_path))  # for <scorer module>
    monkeypatch.delitem(sys.modules, SCORERS, raising=False)
    words = shlex.split(_resolve(command, tmp_path, model_dir))
    output = tmp_path / "outputs"
    if words[0] == "make":
        rc, err, trainer_args = _run_make(words[1:], tmp_path)
        if trainer_args is not None:  # make forwarded it: the trainer must refuse it, and so must its dry run
            from megaflow.trainer.main import main

            args = [*trainer_args[:2], f"trainer.output_dir={output}", *trainer_args[2:]]
            rc = main(args)
            err = capsys.readouterr().err
            assert not output.exists(), "the run directory was created before the input was checked"
            assert main(["--dry-run", *args]) == rc
            assert capsys.readouterr().err == err, "the dry run reports other lines than the run"
    else:
        rc = _load_tool(Path(words[0]).stem).main(words[1:])
        err = capsys.readouterr().err
        assert not (tmp_path / "new_out").exists()
    assert rc == 2 and expected in err, err
    assert "Traceback" not in err


def test_make_still_forwards_good_words():
    rc, _, args = _run_make(["train", "RECIPE=tiny_arith_ppo", "trainer.total_steps=3", "DRY_RUN=1"], Path("."))
    assert rc == 0 and args == ["--recipe", "tiny_arith_ppo", "--dry-run", "trainer.total_steps=3"]


def test_the_empty_value_hint_works_when_typed_through_make(capsys, monkeypatch):
    # `make train trainer.total_steps=` is refused with a suggestion; that suggestion, typed
    # into a shell as `make train <it>` (one shell strips quotes, make's recipe shell again),
    # must reach the trainer as written and load as null.
    from megaflow.topology import load_run
    from megaflow.trainer.main import main

    monkeypatch.delenv("MEGAFLOW_DEBUG", raising=False)
    rc, _, args = _run_make(["train", "trainer.total_steps="], Path("."))
    assert rc == 0 and args[-1] == "trainer.total_steps="
    assert main(args) == 2
    err = capsys.readouterr().err
    suggested = re.findall(r"write (\S+) for null", err)
    assert suggested == ["trainer.total_steps=null"] and "''" not in err, err
    proc = subprocess.run(["bash", "-c", f"make -n --no-print-directory train {suggested[0]}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    line = [ln for ln in proc.stdout.splitlines() if "megaflow.trainer.main" in ln][-1]
    forwarded = shlex.split(line.split("megaflow.trainer.main", 1)[1])
    assert proc.returncode == 0 and forwarded[-1] == suggested[0]
    assert load_run("tiny_arith_grpo", forwarded[2:]).trainer.total_steps is None
