"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py end to end, and their
behaviour on bad input (clear error, no partial output directory)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_tiny import VOCAB, hf_logits
from megaflow.models.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megaflow.models.hf_io import CheckpointError, HFWeights
from megaflow.models.hf_mapping import ModelSpec, UnsupportedModelError
from megaflow.utils.launch import DistributedRunError

REPO = Path(__file__).resolve().parents[2]
VARIANT = "qwen2_bias_tied"  # QKV bias, GQA, tied embeddings: the most transforms at once


def _leftovers(out: Path) -> list[str]:
    """The output directory or any hidden temporary sibling of it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name
                  or p.name.startswith(f".{out.name}."))


@pytest.fixture(scope="module")
def round_trip(tiny_hf_dirs, tmp_path_factory):
    """CLI HF -> megaflow at TP=2, then megaflow -> HF read at TP=1 (another padded
    vocabulary), written in small shards."""
    root = tmp_path_factory.mktemp("tools")
    ckpt, hf_out = root / "ckpt", root / "hf_out"
    cli = subprocess.run([sys.executable, str(REPO / "tools/convert_hf_to_megatron.py"),
                          "--hf-dir", str(tiny_hf_dirs[VARIANT]), "--out", str(ckpt),
                          "--tp", "2"], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    convert_megatron_to_hf(ckpt, hf_out, tp=1, max_shard_bytes=100_000, progress=False)
    return tiny_hf_dirs[VARIANT], ckpt, hf_out, cli.stdout + cli.stderr


@pytest.mark.slow
def test_cli_writes_complete_checkpoint_with_metadata(round_trip):
    _, ckpt, _, output = round_trip
    assert "loading HF weights" in output and "wrote megaflow checkpoint" in output
    meta = json.loads((ckpt / "megaflow_checkpoint.json").read_text())
    assert (meta["tie_word_embeddings"], meta["vocab_size"], meta["padded_vocab_size"]) == (True, VOCAB, 512)
    assert (meta["tp"], meta["pp"], meta["dtype"]) == (2, 1, "float32")
    assert (ckpt / "COMPLETE").is_file() and (ckpt / "hf" / "tokenizer.json").is_file()
    assert _leftovers(ckpt) == ["ckpt"]


@pytest.mark.slow
def test_round_trip_loads_in_transformers_bit_exact(round_trip):
    from transformers import AutoModelForCausalLM

    src, _, hf_out, _ = round_trip
    assert (hf_out / "model.safetensors.index.json").is_file()  # several shards written
    HFWeights(hf_out).validate(ModelSpec.from_hf_config(json.loads((src / "config.json").read_text())))
    stored = {}
    for shard in hf_out.glob("*.safetensors"):
        stored.update(load_file(shard))
    original = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied: no stray head
    assert sorted(stored) == sorted(original)
    assert all(torch.equal(stored[k], original[k]) for k in original)
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    reference = AutoModelForCausalLM.from_pretrained(src).eval()
    assert model.config.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(hf_logits(model, ids), hf_logits(reference, ids))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied through unchanged
        assert (hf_out / name).read_bytes() == (src / name).read_bytes()


def _copy_with(src: Path, dst: Path, edit) -> Path:
    """Copy an HF dir, editing its tensors with ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(src / "model.safetensors"))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _assert_fails_cleanly(hf_dir: Path, out: Path, error, match: str) -> None:
    with pytest.raises(error, match=match):
        convert_hf_to_megatron(hf_dir, out, tp=2, progress=False)
    assert _leftovers(out) == []


def test_missing_tensor(tiny_hf_dirs, tmp_path):
    key = "model.layers.1.self_attn.k_proj.weight"
    bad = _copy_with(tiny_hf_dirs[VARIANT], tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != key})
    _assert_fails_cleanly(bad, tmp_path / "out", CheckpointError, f"missing tensors .*{key}")


def test_extra_tensor(tiny_hf_dirs, tmp_path):
    bad = _copy_with(tiny_hf_dirs[VARIANT], tmp_path / "bad",
                     lambda t: {**t, "model.layers.9.mlp.gate_proj.weight": torch.zeros(1)})
    _assert_fails_cleanly(bad, tmp_path / "out", CheckpointError,
                          "unexpected tensors .*model.layers.9.mlp.gate_proj.weight")


def test_wrong_shape(tiny_hf_dirs, tmp_path):
    key = "model.layers.0.mlp.up_proj.weight"
    bad = _copy_with(tiny_hf_dirs[VARIANT], tmp_path / "bad",
                     lambda t: {**t, key: t[key][:-1].clone()})
    _assert_fails_cleanly(bad, tmp_path / "out", CheckpointError,
                          rf"wrong shapes .*{key}: \(95, 64\) != expected \(96, 64\)")


def test_truncated_safetensors(tiny_hf_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs[VARIANT], bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    _assert_fails_cleanly(bad, tmp_path / "out", CheckpointError, "model.safetensors.*truncated")


def test_unsupported_architecture(tiny_hf_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_hf_dirs[VARIANT], bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (bad / "config.json").write_text(json.dumps(config))
    _assert_fails_cleanly(bad, tmp_path / "out", UnsupportedModelError, "MistralForCausalLM")


def test_tp_that_does_not_divide_heads(tiny_hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="tp=3"):
        convert_hf_to_megatron(tiny_hf_dirs[VARIANT], tmp_path / "out", tp=3, progress=False)
    assert _leftovers(tmp_path / "out") == []


def test_existing_output_is_not_overwritten(tiny_hf_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_hf_to_megatron(tiny_hf_dirs[VARIANT], out, progress=False)
    assert (out / "keep.txt").read_text() == "x"


def test_incomplete_megaflow_checkpoint(tmp_path):
    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="megaflow_checkpoint.json is missing"):
        convert_megatron_to_hf(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert _leftovers(tmp_path / "out") == []


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_megaflow_checkpoint(round_trip, tmp_path, damage):
    _, ckpt, _, _ = round_trip
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    shard = sorted((damaged / "model").glob("*.distcp"))[-1]
    if damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    # the checkpoint's manifest catches both before any tensor is read, naming the file
    expected = f"{shard.name} is missing" if damage == "delete" else f"{shard.name} has 100 bytes, the manifest says"
    with pytest.raises(CheckpointError, match=expected):
        convert_megatron_to_hf(damaged, tmp_path / "out", progress=False)
    assert _leftovers(tmp_path / "out") == []


def _write_then_fail(rank, world_size, tmp):
    (Path(tmp) / f"part{rank}").write_text("partial")
    raise RuntimeError("rank failure on purpose")


@pytest.mark.slow
def test_failure_inside_ranks_leaves_no_partial_output(tmp_path):
    from megaflow.models.convert import _run_in_tmp

    out = tmp_path / "out"
    with pytest.raises(DistributedRunError, match="rank failure on purpose"):
        _run_in_tmp(out, _write_then_fail, 1, timeout_s=120, marker=None)
    assert _leftovers(out) == []


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["missing_tensor", "existing_output", "pp0", "out_under_file", "bad_index"])
def test_cli_expected_errors_are_one_line_and_exit_2(case, tiny_hf_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MEGAFLOW_DEBUG", raising=False)
    src, out = tiny_hf_dirs[VARIANT], tmp_path / "out"
    args, expected = ["--hf-dir", str(src), "--out", str(out)], None
    if case == "missing_tensor":
        key = "model.layers.0.mlp.down_proj.weight"
        bad = _copy_with(src, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != key})
        args[1], expected = str(bad), f"error: HF checkpoint does not match its config: missing tensors (1): {key}"
    elif case == "existing_output":
        out.mkdir()
        (out / "keep.txt").write_text("x")
        expected = f"error: output directory {out} already exists; pass overwrite (--overwrite)"
    elif case == "pp0":
        args += ["--pp", "0"]
        expected = "error: --pp must be >= 1, got 0"
    elif case == "out_under_file":
        (tmp_path / "f").write_text("x")
        args[3] = str(tmp_path / "f" / "out")
        expected = f"error: cannot create output directory {tmp_path / 'f' / 'out'}: {tmp_path / 'f'} is not a directory"
    else:
        bad = tmp_path / "bad"
        shutil.copytree(src, bad)
        (bad / "model.safetensors.index.json").write_text("{not json")
        args[1], expected = str(bad), f"error: {bad / 'model.safetensors.index.json'} is not valid JSON"
    assert _tool("convert_hf_to_megatron").main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    if case == "existing_output":
        assert (out / "keep.txt").read_text() == "x"
    elif case != "out_under_file":  # (nothing can be written under a file)
        assert _leftovers(out) == []


def test_cli_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAFLOW_DEBUG", "1")
    with pytest.raises(CheckpointError, match="does not exist"):
        _tool("convert_hf_to_megatron").main(["--hf-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
