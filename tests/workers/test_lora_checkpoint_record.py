"""The record of an adapter-only LoRA checkpoint (megaflow.workers.checkpointing ``lora.json``):
a resume with other LoRA settings, another frozen base or LoRA off is refused naming the key."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megaflow.workers.checkpointing import _check_lora_record

ENGINE = SimpleNamespace(spec=SimpleNamespace(role="actor"))
SAVED = {"settings": {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["linear_qkv"]},
         "base_model": {"key": "model.path", "path": "/models/a"},
         "base_sha256": {"tp0_pp0": "aa", "tp1_pp0": "bb"}}


def _now(**changes) -> dict:
    now = {k: dict(v) for k, v in SAVED.items()}
    for where, value in changes.items():
        section, key = where.split("__")
        now[section][key] = value
    return now


def test_same_settings_and_base_pass():
    _check_lora_record(ENGINE, Path("/ckpt"), SAVED, _now())


@pytest.mark.parametrize("changes, key", [
    ({"settings__rank": 4}, "actor.lora.rank"),
    ({"settings__alpha": 8.0}, "actor.lora.alpha"),
    ({"settings__dropout": 0.1}, "actor.lora.dropout"),
    ({"settings__target_modules": ["linear_qkv", "linear_fc1"]}, "actor.lora.target_modules"),
    ({"base_sha256__tp1_pp0": "cc"}, "model.path"),
])
def test_other_settings_or_base_are_refused_naming_the_key(changes, key):
    with pytest.raises(ValueError) as err:
        _check_lora_record(ENGINE, Path("/ckpt"), SAVED, _now(**changes))
    assert str(err.value).startswith(f"{key}: "), str(err.value)


def test_lora_off_is_refused():
    with pytest.raises(ValueError, match=r"^actor\.lora\.rank: .* LoRA adapters only"):
        _check_lora_record(ENGINE, Path("/ckpt"), SAVED, None)
