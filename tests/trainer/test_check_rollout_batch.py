"""The controller's one layout check of a rollout's batch (stages.check_rollout_batch)."""
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.trainer.stages import check_rollout_batch


def batch(prompt_lens=(2, 3), resp_lens=(3, 1), P=3, R=3):
    """Left-padded prompts + right-padded responses, built position by position."""
    rows = len(prompt_lens)
    ids = torch.zeros(rows, P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[i, P - p:P + r] = 1
        ids[i, P - p:P + r] = torch.arange(3, 3 + p + r)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    resp = ids[:, P:].clone()
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": resp,
                                "response_mask": mask[:, P:].clone()})


def test_a_valid_rollout_passes():
    check_rollout_batch(batch())


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b.batch.__setitem__("position_ids", b.batch["position_ids"] + 1), r"position_ids must be .*rows \[0, 1\]"),
    (lambda b: b.batch["attention_mask"].__setitem__((1, 1), 0), r"one contiguous span .*rows \[1\]"),
    (lambda b: b.batch["responses"].__setitem__((0, 0), 99), r"responses must equal input_ids\[:, -3:\] .*rows \[0\]"),
    (lambda b: b.batch["response_mask"].__setitem__((1, 2), 1), r"response_mask must be 0 on padding .*rows \[1\]"),
])
def test_each_layout_rule_names_the_rows(mutate, match):
    b = batch()
    mutate(b)
    with pytest.raises(ValueError, match=match):
        check_rollout_batch(b)


def test_missing_fields_and_shapes_are_named():
    b = batch()
    with pytest.raises(ValueError, match=r"returned no \['position_ids'\]"):
        check_rollout_batch(b.select(batch_keys=["input_ids", "attention_mask", "responses", "response_mask"]))
    short = DataProto.from_dict({**{k: b.batch[k] for k in b.batch.keys()}, "responses": b.batch["responses"][:, :2],
                                 "response_mask": b.batch["response_mask"]})
    with pytest.raises(ValueError, match="rollout batch shapes"):
        check_rollout_batch(short)
