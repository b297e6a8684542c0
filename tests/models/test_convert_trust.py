"""tools/convert_megatron_to_hf.py refuses what it cannot trust: a pickle payload in the
distributed checkpoint's index, a flipped byte, a missing COMPLETE marker; and a trainer step
directory is answered with the model directory inside it."""
from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megaflow.models.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megaflow.models.hf_io import CheckpointError

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def ckpt(tiny_hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("trust") / "ckpt"
    convert_hf_to_megatron(tiny_hf_dirs[sorted(tiny_hf_dirs)[0]], out, progress=False)
    return out


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def test_converted_checkpoint_is_sealed(ckpt):
    from megaflow.utils.integrity import verify_manifest

    assert (ckpt / "COMPLETE").is_file() and (ckpt / "MANIFEST.json").is_file()
    assert verify_manifest(ckpt) == sum(1 for p in ckpt.rglob("*") if p.is_file()) - 2


def test_payload_in_dcp_index_refused_by_the_cli_and_never_runs(ckpt, tmp_path):
    damaged = _copy(ckpt, tmp_path)
    marker = tmp_path / "pwned"
    (damaged / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    from megaflow.utils.integrity import write_manifest

    write_manifest(damaged)  # a crafted checkpoint carries a matching manifest
    cli = subprocess.run([sys.executable, str(REPO / "tools/convert_megatron_to_hf.py"), "--ckpt", str(damaged),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert cli.returncode != 0
    assert "refuses to load" in cli.stderr and ".metadata" in cli.stderr, cli.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_flipped_byte_refused_naming_the_file(ckpt, tmp_path):
    damaged = _copy(ckpt, tmp_path)
    shard = sorted((damaged / "model").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupt"):
        convert_megatron_to_hf(damaged, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_complete_marker_required(ckpt, tmp_path):
    damaged = _copy(ckpt, tmp_path)
    (damaged / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        convert_megatron_to_hf(damaged, tmp_path / "out", progress=False)


def test_step_directory_points_to_the_model_inside(ckpt, tmp_path):
    step = tmp_path / "global_step_6"
    shutil.copytree(ckpt, step / "actor" / "model")
    (step / "COMPLETE").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"is not a model checkpoint but holds one: use {step}/actor/model"):
        convert_megatron_to_hf(step, tmp_path / "out", progress=False)
