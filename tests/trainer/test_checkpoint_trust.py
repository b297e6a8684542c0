"""Checkpoints that can be trusted: manifests, no pickled code, resume checks."""
import json
import pickle
import random
from types import SimpleNamespace as ns

import numpy as np
import pytest
import torch

from megaflow.config import ConfigError
from megaflow.trainer.checkpoint import CheckpointManager, read_trainer_state, write_trainer_state
from megaflow.trainer.ppo_trainer import capture_rng_state, non_finite_metrics, restore_rng_state
from megaflow.trainer.resume import check_not_finished, check_resume, config_differences, ResumePoint
from megaflow.utils.integrity import (IntegrityError, check_dcp_pickles, file_sha256, read_dcp_metadata,
                                      verify_manifest, write_manifest)


class _Payload:
    """A pickle that, when loaded by an unrestricted unpickler, creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save(mgr, step, files=None):
    pending = mgr.begin(step)
    (pending.path / "actor").mkdir()
    (pending.path / "actor" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    rng, tensors = capture_rng_state()
    write_trainer_state(pending.path, {"global_step": step, "kl_ctrl": {"value": 0.1},
                                       "train_loader": {"epoch": 0, "position": step}, "rng": rng}, tensors)
    for name, text in (files or {}).items():
        (pending.path / name).write_text(text)
    return mgr.commit(pending, required_parts=("actor", "trainer_state.json"))


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    path = _save(CheckpointManager(tmp_path), 3)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()
                     and p.name not in ("MANIFEST.json", "COMPLETE"))
    assert sorted(manifest["files"]) == on_disk
    import hashlib

    weights = manifest["files"]["actor/weights.bin"]
    assert weights == {"size": 256 * 64, "sha256": hashlib.sha256(bytes(range(256)) * 64).hexdigest()}
    assert verify_manifest(path) == len(on_disk)


def test_flipped_byte_same_size_is_refused_naming_the_file(tmp_path):
    path = _save(CheckpointManager(tmp_path), 3)
    shard = path / "actor" / "weights.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"weights.bin is corrupt: its sha256 differs"):
        verify_manifest(path)
    verify_manifest(path, checksums=False)  # sizes alone cannot see it


@pytest.mark.parametrize("damage", ["delete", "add", "truncate"])
def test_missing_extra_and_resized_files(tmp_path, damage):
    path = _save(CheckpointManager(tmp_path), 3)
    shard = path / "actor" / "weights.bin"
    if damage == "delete":
        shard.unlink()
        expected = "weights.bin is missing"
    elif damage == "add":
        (path / "actor" / "common.pt").write_bytes(b"x")
        expected = "common.pt is not listed"
    else:
        shard.write_bytes(shard.read_bytes()[:100])
        expected = "weights.bin has 100 bytes, the manifest says 16384"
    with pytest.raises(IntegrityError, match=expected):
        verify_manifest(path, checksums=False)


def test_sealed_subdirectory_is_verified_through_its_own_manifest(tmp_path):
    from megaflow.utils.atomic_dir import seal_directory

    root = tmp_path / "ckpt"
    (root / "actor" / "model").mkdir(parents=True)
    (root / "actor" / "model" / "t.bin").write_bytes(b"abc")
    seal_directory(root / "actor" / "model", {"format": "x"})
    (root / "state.json").write_text("{}")
    manifest = write_manifest(root)
    assert manifest["sealed"] == ["actor/model"]
    assert "actor/model/t.bin" not in manifest["files"] and "actor/model/MANIFEST.json" in manifest["files"]
    assert verify_manifest(root) == 3 + 1  # state.json, the inner manifest and marker; t.bin inside
    (root / "actor" / "model" / "t.bin").write_bytes(b"abd")
    with pytest.raises(IntegrityError, match="t.bin is corrupt"):
        verify_manifest(root)


def test_trainer_state_round_trip_restores_every_rng_exactly(tmp_path):
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    data, tensors = capture_rng_state()
    write_trainer_state(tmp_path, {"global_step": 4, "rng": data}, tensors)
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    state, loaded = read_trainer_state(tmp_path)
    restore_rng_state(state["rng"], loaded)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == expected
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 4


def test_pickled_payload_in_rng_state_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    write_trainer_state(tmp_path, {"global_step": 1, "rng": {}}, {"torch": torch.get_rng_state()})
    torch.save({"torch": _Payload(marker)}, tmp_path / "rng_state.pt")
    with pytest.raises(IntegrityError, match="rng_state.pt holds a pickle that megaflow refuses"):
        read_trainer_state(tmp_path)
    assert not marker.exists()


def test_old_pickled_trainer_state_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"rng": _Payload(marker)}, tmp_path / "trainer_state.pt")
    with pytest.raises(IntegrityError, match="pickled trainer_state.pt of an older megaflow"):
        read_trainer_state(tmp_path)
    assert not marker.exists()


def _dcp_dir(tmp_path):
    """A real (single-process) torch distributed checkpoint with a tensor and a byte item."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "extra": {"lr": 0.5}}, checkpoint_id=str(out), no_dist=True)
    return out


def test_dcp_index_read_without_unrestricted_unpickling(tmp_path):
    out = _dcp_dir(tmp_path)
    metadata = check_dcp_pickles(out)
    assert metadata.state_dict_metadata["w"].size == torch.Size([6])
    marker = tmp_path / "pwned"
    (out / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(IntegrityError, match=r"\.metadata holds a pickle that references io.open"):
        read_dcp_metadata(out)
    assert not marker.exists()


def test_dcp_byte_item_with_payload_is_refused(tmp_path):
    out = _dcp_dir(tmp_path)
    metadata = read_dcp_metadata(out)
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == "extra.lr"
                      or i.fqn.startswith("extra")]
    marker = tmp_path / "pwned"
    import io

    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    payload = buf.getvalue()
    # Append the payload to the file and point the index at it (as a crafted checkpoint would).
    shard = out / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(payload)
    info.offset, info.length = offset, len(payload)
    (out / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(IntegrityError, match=rf"item '{index.fqn}'\) holds a pickle that megaflow refuses"):
        check_dcp_pickles(out)
    assert not marker.exists()


def test_verify_refuses_payload_in_a_checkpoint_even_with_a_matching_manifest(tmp_path):
    mgr = CheckpointManager(tmp_path)
    marker = tmp_path / "pwned"
    pending = mgr.begin(2)
    (pending.path / "actor").mkdir()
    torch.save({"x": _Payload(marker)}, pending.path / "actor" / "scheduler.pt")
    write_trainer_state(pending.path, {"global_step": 2, "rng": {}}, {"torch": torch.get_rng_state()})
    path = mgr.commit(pending, required_parts=("actor",))
    with pytest.raises(IntegrityError, match="scheduler.pt holds a pickle"):
        mgr.verify(path)
    assert not marker.exists()


def test_resolve_and_partials(tmp_path):
    mgr = CheckpointManager(tmp_path / "checkpoints")
    good = _save(mgr, 1)
    with pytest.raises(FileNotFoundError, match="'autoo' is neither 'auto', 'disable' nor an existing"):
        mgr.resolve("autoo")
    with pytest.raises(FileNotFoundError, match=f"newest complete one inside it is {good}"):
        mgr.resolve(str(tmp_path))
    stale = mgr.begin(2).path
    (stale / "half.bin").write_text("x")
    assert mgr.remove_partials() == [stale] and not stale.exists() and good.is_dir()


def _cfg(tmp_path, **trainer):
    tr = dict(output_dir=str(tmp_path), project_name="p", experiment_name="e", resume="auto",
              max_ckpt_to_keep=None, resume_ignore_config_diff=False)
    tr.update(trainer)
    return ns(trainer=ns(**tr))


def test_check_resume_names_the_key_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer.resume: 'autoo' is neither"):
        check_resume(_cfg(tmp_path, resume="autoo"))
    with pytest.raises(ConfigError, match="trainer.resume: .*does not exist|neither"):
        check_resume(_cfg(tmp_path, resume=str(tmp_path / "nope")))
    assert check_resume(_cfg(tmp_path)) is None  # auto, nothing saved yet: a fresh start
    mgr = CheckpointManager(tmp_path / "p" / "e" / "checkpoints")
    path = _save(mgr, 4)
    data = bytearray((path / "trainer_state.json").read_bytes())
    data[-2] = ord(" ") if data[-2] != ord(" ") else ord("\t")
    (path / "trainer_state.json").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"trainer.resume: checkpoint .* cannot be trusted: .*trainer_state.json "
                                          r"is corrupt"):
        check_resume(_cfg(tmp_path))


def test_config_difference_rule():
    saved = {"actor": {"optim": {"lr": 1e-3}, "param_offload": False, "tp": 2},
             "trainer": {"total_steps": 6, "logger": ["jsonl"]}, "ray": {"num_cpus": 2}, "algorithm": {"x": [1, 2]}}
    now = {"actor": {"optim": {"lr": 2e-3}, "param_offload": True, "tp": 2},
           "trainer": {"total_steps": 60, "logger": ["console"]}, "ray": {"num_cpus": 8},
           "algorithm": {"x": (1, 2)}, "new": {"key": 1}}
    assert config_differences(saved, now) == [("actor.optim.lr", 1e-3, 2e-3), ("new.key", "<absent>", 1)]


def test_finished_run_is_refused():
    point = ResumePoint(path="ckpt/global_step_6", step=6)
    with pytest.raises(ConfigError, match="trainer.total_steps: this run already finished: .* at step 6 and the "
                                          "run has 6 steps"):
        check_not_finished(point, 6)
    check_not_finished(point, 7)
    check_not_finished(None, 1)


def test_non_finite_losses_and_grad_norms():
    metrics = {"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "actor/entropy": float("nan"),
               "critic/vf_loss": 1.0, "critic/grad_norm": float("nan"), "reward/mean": float("nan")}
    bad = non_finite_metrics(metrics, {"actor": 1.0, "critic": 0.0})
    assert sorted(bad) == ["actor/grad_norm", "actor/pg_loss"]  # critic norm unclipped: not computed
    assert bad["actor/grad_norm"] == float("inf")
    assert non_finite_metrics({"actor/loss": 0.5, "actor/grad_norm": 2.0}, {"actor": 1.0}) == {}


def test_fit_stops_at_the_step_with_a_nan_loss_before_saving_it(tmp_path, monkeypatch):
    from megaflow.protocol import DataProto
    from megaflow.trainer.ppo_trainer import NonFiniteMetricsError
    from test_ppo_trainer_fake import FakeActor, run

    def update_actor(self, batch):  # step 2's update diverges
        FakeActor_update(self, batch)
        loss = float("nan") if self.version == 2 else 0.5
        return [{"actor/pg_loss": loss}]

    FakeActor_update = FakeActor.update_actor
    monkeypatch.setattr(FakeActor, "update_actor", update_actor)
    trainer, _ = run(tmp_path, total_steps=4)
    with pytest.raises(NonFiniteMetricsError, match=r"training diverged at step 2: non-finite actor/pg_loss=nan"):
        trainer.fit()
    assert [s for s, _ in trainer.checkpoints.complete_checkpoints()] == [1]  # step 2 was not saved
