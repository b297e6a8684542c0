"""Dynamic sampling (algorithm.filter_groups): kept batches equal a filter written by hand."""
import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.trainer.dynamic_sampling import fill_informative, split_groups

N, R = 3, 4  # samples per prompt, response length


def scored_round(group_scores: list[list[float]], tag: str, acc: list[list[float]] | None = None) -> DataProto:
    """A scored rollout batch: group g's rows get ``group_scores[g]`` on their last token."""
    rows = [s for g in group_scores for s in g]
    scores = torch.zeros(len(rows), R)
    scores[:, -1] = torch.tensor(rows)
    uids = [f"{tag}{g}" for g, group in enumerate(group_scores) for _ in group]
    nt = {"uid": np.array(uids, dtype=object)}
    if acc is not None:
        nt["reward_acc"] = np.array([a for g in acc for a in g], dtype=object)
    return DataProto.from_dict({"token_level_scores": scores,
                                "responses": torch.arange(len(rows) * R).reshape(-1, R)}, non_tensors=nt)


def hand_filter(rounds: list[DataProto], target: int) -> DataProto:
    """The first ``target`` groups whose scores are not all equal, over the rounds in order,
    then flat groups if short: a loop over rows, independent of the module's code."""
    good, flat = [], []
    for batch in rounds:
        scores = batch.batch["token_level_scores"].sum(-1).tolist()
        by_uid: dict[str, list[int]] = {}
        for i, uid in enumerate(batch.non_tensor_batch["uid"]):
            by_uid.setdefault(uid, []).append(i)
        for uid, rows in by_uid.items():
            values = {scores[i] for i in rows}
            (good if len(values) > 1 else flat).append((batch, rows))
    chosen = good[:target] + flat[:max(0, target - len(good))]
    keep = {id(b): set() for b, _ in chosen}
    for b, rows in chosen:
        keep[id(b)].update(rows)
    return DataProto.concat([b[sorted(keep[id(b)])] for b in rounds if id(b) in keep])


def test_split_groups_by_the_score_and_by_a_named_field():
    batch = scored_round([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25]], "a",
                         acc=[[1, 0, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]])
    assert split_groups(batch) == (["a1", "a3"], ["a0", "a2"])
    assert split_groups(batch, "acc") == (["a0"], ["a1", "a2", "a3"])
    with pytest.raises(KeyError, match="filter_groups.metric='format'.*available: score, acc"):
        split_groups(batch, "format")


def test_kept_batch_equals_a_hand_filter_over_the_rounds():
    gen = torch.Generator().manual_seed(0)
    rounds = [scored_round(torch.randint(0, 2, (4, N), generator=gen).float().tolist(), f"r{i}")
              for i in range(6)]
    calls = []

    def generate_round(index: int) -> DataProto:
        calls.append(index)
        return rounds[index]

    batch, metrics = fill_informative(generate_round, 4, max_extra_rounds=5)
    used = rounds[:len(calls)]
    expected = hand_filter(used, 4)
    assert calls == list(range(len(calls))) and 1 < len(calls) <= 6
    assert batch.non_tensor_batch["uid"].tolist() == expected.non_tensor_batch["uid"].tolist()
    assert torch.equal(batch.batch["responses"], expected.batch["responses"])
    assert torch.equal(batch.batch["token_level_scores"], expected.batch["token_level_scores"])
    assert len(batch) == 4 * N and metrics["filter_groups/cap_reached"] == 0.0
    informative = sum(len(split_groups(b)[0]) for b in used)
    assert metrics["filter_groups/kept_share"] == informative / (4 * len(used))
    assert metrics["filter_groups/rounds"] == len(used) and metrics["filter_groups/padded_groups"] == 0.0


def test_the_cap_completes_the_batch_with_flat_groups_and_says_so():
    rounds = [scored_round([[1, 1, 1], [0, 1, 1], [0, 0, 0]], "a"),
              scored_round([[0, 0, 0], [1, 1, 1], [1, 0, 0]], "b"),
              scored_round([[0, 1, 0], [0, 1, 0], [0, 1, 0]], "c")]  # never generated: the cap is 1
    batch, metrics = fill_informative(lambda i: rounds[i], 3, max_extra_rounds=1)
    assert batch.non_tensor_batch["uid"].tolist() == ["a0"] * 3 + ["a1"] * 3 + ["b2"] * 3
    assert metrics == {"filter_groups/rounds": 2.0, "filter_groups/generated_groups": 6.0,
                       "filter_groups/informative_groups": 2.0, "filter_groups/kept_share": 2 / 6,
                       "filter_groups/padded_groups": 1.0, "filter_groups/cap_reached": 1.0}
    assert torch.equal(batch.batch["responses"], hand_filter(rounds[:2], 3).batch["responses"])


def test_rounds_with_different_reward_fields_concatenate():
    a = scored_round([[1, 1, 1]], "a", acc=[[1, 1, 1]])
    b = scored_round([[0, 1, 0]], "b")  # a data source whose scorer returns no 'acc'
    batch, _ = fill_informative(lambda i: [a, b][i], 1, max_extra_rounds=1)
    assert batch.non_tensor_batch["uid"].tolist() == ["b0"] * 3
    assert all(np.isnan(v) for v in batch.non_tensor_batch["reward_acc"])


@pytest.mark.parametrize("overrides, key, says", [
    (["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=remax"], "algorithm.filter_groups.enable",
     "set algorithm.adv_estimator to one of grpo"),
    (["algorithm.filter_groups.max_extra_rounds=-1"], "algorithm.filter_groups.max_extra_rounds", ">= 0"),
    (["algorithm.filter_groups.metric=a-b"], "algorithm.filter_groups.metric", "a reward field name"),
])
def test_filter_groups_settings_that_cannot_work_are_refused_at_load(overrides, key, says):
    from megaflow.config import ConfigError
    from megaflow.topology import load_run

    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", overrides)
    assert err.value.key == key and says in str(err.value)


def test_filter_groups_is_off_by_default_and_loads_on_the_grpo_recipe():
    from megaflow.topology import load_run

    assert not load_run("tiny_arith_grpo").algorithm.filter_groups.enable
    fg = load_run("tiny_arith_grpo", ["algorithm.filter_groups.enable=true",
                                         "algorithm.filter_groups.metric=acc"]).algorithm.filter_groups
    assert fg.enable and fg.metric == "acc" and fg.max_extra_rounds == 4
