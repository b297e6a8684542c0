"""Sample generations: picked, decoded and scored rows, and where they are written."""
import json
import math

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.trainer.generations import sample_generations
from megaflow.utils.tracking import Tracking


def decode(ids):
    return " ".join(f"t{i}" for i in ids)


def scored_batch():
    """2 prompts x 2 samples; prompts left-padded (pad 0) to 3, responses right-padded to 3."""
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]])
    prompt_mask = (prompts != 0).long()
    responses = torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16], [17, 18, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    scores = torch.zeros(4, 3)
    scores[0, 1], scores[2, 2], scores[3, 1] = 0.75, 1.0, 0.25
    return DataProto.from_dict(
        {"prompts": prompts, "responses": responses, "response_mask": response_mask,
         "attention_mask": torch.cat([prompt_mask, response_mask], -1), "token_level_scores": scores},
        non_tensors={"uid": ["a", "a", "b", "b"], "data_source": ["gsm8k"] * 4, "ground_truth": ["3", "3", "4", "4"],
                     "reward_score": np.array([0.5, 0.0, 1.0, 0.25], dtype=object),
                     "reward_acc": np.array([0.0, 0.0, 1.0, math.nan], dtype=object),
                     "reward_format": np.array([1.0, 0.0, 1.0, 1.0], dtype=object)})


def test_one_decoded_sample_per_prompt_with_its_reward_parts():
    records = sample_generations(scored_batch(), decode, count=5)
    assert records == [
        {"data_source": "gsm8k", "prompt": "t5 t6", "response": "t11 t12", "response_tokens": 2, "ground_truth": "3",
         "reward": {"total": 0.75, "score": 0.5, "acc": 0.0, "format": 1.0}},
        {"data_source": "gsm8k", "prompt": "t7 t8 t9", "response": "t14 t15 t16", "response_tokens": 3,
         "ground_truth": "4", "reward": {"total": 1.0, "score": 1.0, "acc": 1.0, "format": 1.0}}]
    assert len(sample_generations(scored_batch(), decode, count=1)) == 1
    assert sample_generations(scored_batch(), decode, count=0) == []


def test_generations_go_to_the_console_jsonl_and_tensorboard(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = sample_generations(scored_batch(), decode, count=2)
    records[1]["response"] = "word " * 60  # long: the console line is cut, the file keeps all
    with Tracking("p", "e", backends=["console", "jsonl", "tensorboard"], log_dir=tmp_path) as tracker:
        tracker.log_generations(records, step=4, split="val")
    out = capsys.readouterr().out
    assert "[step 4] val samples:" in out and "[total=0.75 score=0.5 acc=0 format=1] (2 tokens)" in out
    assert "prompt: t5 t6" in out and "response: t11 t12" in out
    assert "response: " + "word " * 20 + "...\n" in out  # the first 100 characters
    lines = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [(4, "val"), (4, "val")]
    assert lines[1]["response"] == "word " * 60 and lines[0]["reward"]["acc"] == 0.0
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("generations/val/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "total=0.75, score=0.5, acc=0, format=1" in text and "t11 t12" in text


def test_training_logs_samples_every_n_steps_and_after_the_last(tmp_path):
    from test_ppo_trainer_fake import run

    logged = []

    class Tracker:
        def log(self, metrics, step):
            pass

        def log_generations(self, records, step, split):
            logged.append((step, split, records))

    trainer, actor = run(tmp_path, total_steps=3)  # trainer.generations_every=2, generations_count=1
    trainer.tracker, trainer.decode = Tracker(), decode
    trainer.fit()
    assert [(step, split, len(records)) for step, split, records in logged] == [(2, "train", 1), (3, "train", 1)]
    last = actor.updates[-1]
    first_row = last.batch["responses"][0][last.batch["response_mask"][0].bool()]
    assert logged[-1][2][0]["response"] == decode(first_row.tolist())
    assert trainer.cfg.trainer.generations_every == 2


def test_every_validation_logs_its_first_prompts():
    from types import SimpleNamespace

    from megaflow.trainer.ppo_trainer import RayPPOTrainer

    logged = []
    tracker = SimpleNamespace(log_generations=lambda records, step, split: logged.append((step, split, records)))
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(rollout=SimpleNamespace(val_do_sample=False),
                            trainer=SimpleNamespace(generations_count=1)),
        tracker=tracker, decode=decode, global_step=7, val_loader=[scored_batch()],
        rollouts=SimpleNamespace(sync=lambda: None), rollout=lambda batch, n, greedy: batch,
        score=lambda batch, keep_reward_fields: batch)
    RayPPOTrainer.validate(trainer)
    assert logged == [(7, "val", sample_generations(scored_batch(), decode, count=1))]
