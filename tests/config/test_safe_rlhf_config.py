"""algorithm.safe_rlhf: each key's effect on the cost, the multiplier and the roles, and the
bad values refused at load naming the key."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.config.typed import ConfigError
from megaflow.data.arith import build_arith_tokenizer
from megaflow.protocol import DataProto
from megaflow.config.loader import read_yaml, resolve_recipe
from megaflow.topology import load_run, run_from_dict
from megaflow.topology.role_spec import RoleSpec
from megaflow.topology.sizes import pools_in_use
from megaflow.trainer.safe_rlhf import SafeRLHF

RECIPE = "tiny_arith_safe_ppo"


def _safe(*overrides: str) -> SafeRLHF:
    return SafeRLHF(load_run(RECIPE, overrides), build_arith_tokenizer())


def _costs(safe: SafeRLHF, texts: list[str]) -> list[float]:
    tok = build_arith_tokenizer()
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(map(len, ids))
    batch = DataProto.from_dict(
        {"responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
         "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])},
        {"data_source": ["arith"] * len(ids), "ground_truth": ["0"] * len(ids)})
    return safe.add_costs(batch).batch["token_level_costs"].sum(-1).tolist()


def test_cost_function_and_cost_kwargs_choose_the_cost():
    texts = ["19<eos>", "3<eos>", "33<eos>"]
    assert _costs(_safe(), texts) == [1.0, 0.0, 0.0]  # the recipe: algorithm.safe_rlhf.cost_kwargs {digit: 9}
    assert _costs(_safe("algorithm.safe_rlhf.cost_kwargs={digit: 3}"), texts) == [0.0, 1.0, 1.0]
    custom = _safe("algorithm.safe_rlhf.cost_function=tests.config.test_safe_rlhf_config:length_cost",
                   "algorithm.safe_rlhf.cost_limit=20.0")
    assert _costs(custom, texts) == pytest.approx([7.0 / 9, 6.0 / 9, 7.0 / 9])  # the text's length (EOS kept) / digit


def length_cost(solution_str, ground_truth, extra_info=None, *, digit):
    return len(solution_str) / digit


def test_lambda_keys_drive_the_dual_ascent_by_hand():
    safe = _safe("algorithm.safe_rlhf.cost_limit=0.25", "algorithm.safe_rlhf.lambda_init=2.0",
                 "algorithm.safe_rlhf.lambda_lr=0.3", "algorithm.safe_rlhf.lambda_max=null")
    assert safe.multiplier.update(0.75) == pytest.approx(math.exp(math.log(2.0) + 0.3 * 2.0 * (0.75 - 0.25)))
    capped = _safe("algorithm.safe_rlhf.lambda_init=2.0", "algorithm.safe_rlhf.lambda_max=2.5",
                   "algorithm.safe_rlhf.lambda_lr=0.3")
    assert capped.multiplier.update(1.0) == pytest.approx(2.5)


def test_enable_adds_the_cost_critic_on_the_critics_pool_with_its_settings():
    on = load_run(RECIPE)
    tree = read_yaml(resolve_recipe(RECIPE))
    del tree["algorithm"]["safe_rlhf"]  # the same recipe without Safe RLHF (its keys would be refused when off)
    off = run_from_dict(tree)
    assert pools_in_use(on) == {"global": ("actor", "ref", "critic", "cost_critic")}
    assert pools_in_use(off) == {"global": ("actor", "ref", "critic")}
    spec = RoleSpec(on, "cost_critic", 10)
    assert spec.section is on.critic and spec.head == "value" and spec.trains
    assert spec.mini_batch_size_per_dp_rank == RoleSpec(on, "critic", 10).mini_batch_size_per_dp_rank
    from megaflow.dryrun.plan import build_plan

    plan, plain = build_plan(on), build_plan(off)  # the planner counts the second critic's memory
    assert plan.role("cost_critic").memory == plan.role("critic").memory
    with pytest.raises(KeyError):
        plain.role("cost_critic")
    phases = {ph.phase: ph.total for pool in plan.pools for ph in pool.phases}
    critic_resident = plan.role("critic").memory.resident
    assert phases["ref forward"] == pytest.approx(
        {ph.phase: ph.total for pool in plain.pools for ph in pool.phases}["ref forward"] + critic_resident)


@pytest.mark.parametrize("overrides, key, says", [
    (["algorithm.safe_rlhf.lambda_lr=-0.1"], "algorithm.safe_rlhf.lambda_lr", "must be > 0"),
    (["algorithm.safe_rlhf.lambda_init=0"], "algorithm.safe_rlhf.lambda_init", "must be > 0"),
    (["algorithm.safe_rlhf.lambda_max=-1"], "algorithm.safe_rlhf.lambda_max", "must be > 0"),
    (["algorithm.safe_rlhf.cost_limit=1.5"], "algorithm.safe_rlhf.cost_limit", "range [0.0, 1.0]"),
    (["algorithm.safe_rlhf.cost_limit=-0.1"], "algorithm.safe_rlhf.cost_limit", "range [0.0, 1.0]"),
    (["algorithm.safe_rlhf.cost_kwargs={digit: 12}"], "algorithm.safe_rlhf.cost_kwargs.digit", "0-9"),
    (["algorithm.safe_rlhf.cost_kwargs={digit: 1, colour: red}"], "algorithm.safe_rlhf.cost_kwargs", "only 'digit'"),
    (["algorithm.safe_rlhf.cost_function=nonsense"], "algorithm.safe_rlhf.cost_function", "package.module:function"),
    (["algorithm.adv_estimator=grpo", "critic.enabled=false"], "algorithm.safe_rlhf.enable", "adv_estimator=gae"),
])
def test_bad_values_are_refused_at_load_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load_run(RECIPE, overrides)
    assert err.value.key == key and says in str(err.value)


def test_a_cost_function_that_does_not_import_is_named_before_the_run():
    with pytest.raises(ConfigError, match="algorithm.safe_rlhf.cost_function.*no_such_module"):
        _safe("algorithm.safe_rlhf.cost_function=no_such_module:cost")
