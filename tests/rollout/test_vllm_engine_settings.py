"""What :class:`VLLMRollout` asks of vLLM for ``enforce_eager`` and ``sleep_level`` (no engine:
the platform and ``vllm.LLM`` are recorders)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig


class RecordingLLM:
    def __init__(self) -> None:
        self.calls = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags)))


def _engine(tmp_path, *, on_cpu: bool, **config) -> VLLMRollout:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    engine = VLLMRollout.__new__(VLLMRollout)  # no vLLM engine: the settings only
    engine.config = VLLMRolloutConfig(str(tmp_path), **config)
    engine._platform = SimpleNamespace(is_cpu=lambda: on_cpu, is_sleep_mode_available=lambda: not on_cpu)
    engine._llm, engine._asleep, engine._weights_valid, engine._invalid_reason = RecordingLLM(), set(), True, ""
    return engine


@pytest.mark.parametrize("on_cpu, setting, expected", [
    (True, None, True), (False, None, False),  # by device: eager on CPU, CUDA graphs on GPUs
    (False, True, True), (True, False, False)])
def test_enforce_eager_by_device_unless_set(tmp_path, on_cpu, setting, expected):
    engine = _engine(tmp_path, on_cpu=on_cpu, enforce_eager=setting)
    assert engine._engine_kwargs("external_launcher")["enforce_eager"] is expected


@pytest.mark.parametrize("level, valid_after_sleep", [(1, True), (2, False)])
def test_sleep_level_reaches_vllm_and_level_2_invalidates_the_weights(tmp_path, level, valid_after_sleep):
    engine = _engine(tmp_path, on_cpu=False, sleep_level=level)
    engine.sleep()
    assert engine._llm.calls == [("sleep", level)]
    assert engine.weights_valid is valid_after_sleep
    engine.wake_up()
    assert engine._llm.calls[-1] == ("wake_up", ("kv_cache", "weights"))


def test_no_sleep_on_cpu(tmp_path):
    engine = _engine(tmp_path, on_cpu=True, sleep_level=2)
    engine.sleep()
    assert engine._llm.calls == [] and engine.weights_valid


@pytest.mark.parametrize("rank, vllm_rank", [(1, 1), (4, 8), (8, 8), (9, 16), (300, 320)])
def test_lora_engine_rounds_the_rank_up_to_one_vllm_accepts(tmp_path, rank, vllm_rank):
    kwargs = _engine(tmp_path, on_cpu=True, max_lora_rank=rank, max_lora_versions=3)._engine_kwargs("uni")
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"], kwargs["max_cpu_loras"]) == (
        True, vllm_rank, 1, 3)


def test_no_lora_by_default_and_bad_lora_settings_are_named(tmp_path):
    assert "enable_lora" not in _engine(tmp_path, on_cpu=True)._engine_kwargs("uni")
    with pytest.raises(ValueError, match=r"VLLMRolloutConfig.max_lora_rank must be in \[0, 512\], got 513"):
        _engine(tmp_path, on_cpu=True, max_lora_rank=513)
    with pytest.raises(ValueError, match="VLLMRolloutConfig.max_lora_versions must be >= 1, got 0"):
        _engine(tmp_path, on_cpu=True, max_lora_rank=8, max_lora_versions=0)
