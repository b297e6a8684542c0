"""Config keys whose effect no other test showed: each test changes the key and checks what the
run-time consumer (the dataset, the prompt loader, Ray's start, the validation switch) does
differently, against a value computed here independently. Fast: no Ray, no processes."""
from __future__ import annotations

import os

import pytest

from megaflow.config import ConfigError

from megaflow.data.arith import ArithTaskConfig, build_arith_tokenizer, generate_arith_splits
from megaflow.data.io import write_rows
from megaflow.topology import run_from_dict
from megaflow.trainer import main as trainer_main
from megaflow.trainer.preflight import load_datasets, uses_validation


def _files_tree(tiny, train, val=None, **data):
    """A config tree reading prompt files instead of the built-in task."""
    tree = tiny(data={"task": None, "train_files": [str(train)], "val_files": [str(val)] if val else [], **data})
    return tree


@pytest.fixture(scope="module")
def arith_rows():
    return generate_arith_splits(ArithTaskConfig(num_train=24, num_val=6, min_operand=0, max_operand=99, seed=3))


def _renamed(rows, column):
    return [{(column if k == "prompt" else k): v for k, v in row.items()} for row in rows]


def _template_ids(tok, messages):
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset(tmp_path, tiny, arith_rows):
    tok = build_arith_tokenizer()
    # arith's own template renders the content unchanged; one that repeats it tells the two modes apart
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}"
    rows = arith_rows["train"]
    plain = write_rows(rows, tmp_path / "plain.jsonl")
    renamed = write_rows(_renamed(rows, "question"), tmp_path / "question.jsonl")

    # data.prompt_key: the column the prompts are read from
    cfg = run_from_dict(_files_tree(tiny, renamed, prompt_key="question", max_prompt_length=64))
    assert len(load_datasets(cfg, tok).train_dataset) == len(rows)
    with pytest.raises(ConfigError) as err:
        load_datasets(run_from_dict(_files_tree(tiny, renamed, max_prompt_length=64)), tok)
    assert err.value.key == "data.train_files" and "prompt" in str(err.value)

    # data.apply_chat_template: the chat template's rendering, or the raw content with special tokens
    templated = load_datasets(run_from_dict(_files_tree(tiny, plain, max_prompt_length=64)), tok).train_dataset
    raw = load_datasets(run_from_dict(_files_tree(tiny, plain, max_prompt_length=64, apply_chat_template=False)),
                        tok).train_dataset
    messages = rows[0]["prompt"]
    assert list(templated.prompt_ids[0]) == _template_ids(tok, messages)
    assert list(raw.prompt_ids[0]) == tok("\n".join(m["content"] for m in messages))["input_ids"]
    assert list(templated.prompt_ids[0]) != list(raw.prompt_ids[0])

    # data.max_prompt_length with data.filter_overlong_prompts: drop, or refuse naming the files key
    lengths = sorted(len(_template_ids(tok, row["prompt"])) for row in rows)
    limit = lengths[-1] - 1  # the longest prompts do not fit
    kept = sum(n <= limit for n in lengths)
    assert 0 < kept < len(rows)  # one- and two-digit operands: prompts of several lengths
    filtered = load_datasets(run_from_dict(_files_tree(tiny, plain, max_prompt_length=limit)), tok)
    assert len(filtered.train_dataset) == kept < len(rows)
    with pytest.raises(ConfigError) as err:
        load_datasets(run_from_dict(_files_tree(tiny, plain, max_prompt_length=limit,
                                                filter_overlong_prompts=False)), tok)
    assert err.value.key == "data.train_files"


class _Batch(list):
    """What the patched collate function returns: the indices, with the loader's meta_info."""

    def __init__(self, items):
        super().__init__(items)
        self.meta_info = {}


def _epoch(loader):
    return [list(batch) for batch in loader]


def test_data_loader_keys_reach_the_prompt_loaders(tiny, monkeypatch):
    import megaflow.data

    monkeypatch.setattr(megaflow.data, "collate_fn", _Batch)
    inputs = type("Inputs", (), {"train_dataset": list(range(32)), "val_dataset": list(range(10))})()

    def loaders(**data):
        return trainer_main.build_loaders(run_from_dict(tiny(data=data, actor={"ppo_mini_batch_size": 4})), inputs)

    train, val, n = loaders(shuffle=False, train_batch_size=8, val_batch_size=4)
    assert n == 32 and _epoch(train) == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert _epoch(val) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # data.val_batch_size, last batch kept
    assert _epoch(loaders(train_batch_size=8)[1]) == [list(range(10))]  # null: the whole set at once
    seed1, seed1_again, seed2 = (_epoch(loaders(shuffle=True, seed=s, train_batch_size=16)[0]) for s in (1, 1, 2))
    assert [len(b) for b in seed1] == [16, 16]  # data.train_batch_size prompts per batch
    assert sorted(sum(seed1, [])) == list(range(32)) and sum(seed1, []) != list(range(32))
    assert seed1 == seed1_again and seed1 != seed2  # data.seed picks the permutation


def test_validation_runs_only_with_val_files_and_a_cadence_or_a_pre_train_check(tiny):
    def validates(**trainer):
        return uses_validation(run_from_dict(tiny(trainer=trainer)), ["val.parquet"])

    assert not validates(test_freq=0, val_before_train=False)
    assert validates(test_freq=0, val_before_train=True)  # trainer.val_before_train
    assert validates(test_freq=5)  # trainer.test_freq
    assert not uses_validation(run_from_dict(tiny(trainer={"test_freq": 5})), [])


def test_ray_keys_reach_ray_init(tiny, monkeypatch):
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(trainer_main, "_started_ray", False)
    cfg = run_from_dict(tiny(ray={"namespace": "runs-a", "include_dashboard": True,
                                  "dashboard_host": "127.0.0.2", "num_cpus": 3}))
    trainer_main.init_ray(cfg)
    (kwargs,) = calls
    assert kwargs["address"] == "local"
    assert (kwargs["namespace"], kwargs["include_dashboard"]) == ("runs-a", True)
    assert (kwargs["dashboard_host"], kwargs["num_cpus"]) == ("127.0.0.2", 3)


def test_local_ray_workers_inherit_their_environment_and_normal_priority(tiny, monkeypatch):
    import ray

    names = ("OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS", "RAY_worker_niceness")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.append((kwargs, {n: os.environ.get(n) for n in names})))
    monkeypatch.setattr(trainer_main, "_started_ray", False)
    trainer_main.init_ray(run_from_dict(tiny()))
    (kwargs, env), = seen
    # no job runtime_env (Ray's prestarted workers then match the job's actors); the raylet
    # started inside ray.init inherits the variables instead, niceness 0 among them
    assert "runtime_env" not in kwargs
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "ignore::FutureWarning" in env["PYTHONWARNINGS"] and env["RAY_worker_niceness"] == "0"
    assert all(os.environ.get(n) is None for n in names)  # this process's environment is as before
    # a value the user exported is kept, and stays exported afterwards
    monkeypatch.setenv("RAY_worker_niceness", "5")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    seen.clear()
    trainer_main.init_ray(run_from_dict(tiny()))
    assert (seen[0][1]["RAY_worker_niceness"], seen[0][1]["VLLM_LOGGING_LEVEL"]) == ("5", "INFO")
    assert os.environ["RAY_worker_niceness"] == "5" and os.environ.get("OMP_NUM_THREADS") is None


def test_reward_keys_shape_the_runs_reward_table(tiny):
    from megaflow.rewards import arith

    def score(cfg, source, text, truth):
        return trainer_main.build_reward_fn(cfg, tokenizer=None).table.spec(source).fn(text, truth, None)["score"]

    # reward.functions: a scorer registered for a new data source
    custom = run_from_dict(tiny(reward={"functions": {"toy": "megaflow.rewards.arith:compute_score"}}))
    answer = "7" + arith.EOS_TOKEN  # a correct, well-formed arith response
    assert score(custom, "toy", answer, 7) == arith.compute_score(answer, 7)["score"] == 1.0
    with pytest.raises(ValueError, match="toy"):
        trainer_main.build_reward_fn(run_from_dict(tiny()), tokenizer=None).table.spec("toy")
    # reward.format_weight and reward.format_pattern: (1 - w) * task + w * [pattern fullmatches]
    w = 0.25
    for pattern, fmt in ((r"7<eos>", 1.0), (r"#\d+", 0.0)):
        cfg = run_from_dict(tiny(reward={"format_weight": w, "format_pattern": pattern}))
        assert score(cfg, "arith", answer, 7) == pytest.approx((1 - w) * 1.0 + w * fmt)
    assert score(run_from_dict(tiny()), "arith", answer, 7) == 1.0  # weight 0: the task score alone


def test_run_directory_is_output_dir_project_experiment(tiny, tmp_path):
    from megaflow.topology.sizes import run_dir_of

    cfg = run_from_dict(tiny(trainer={"output_dir": str(tmp_path / "out"), "project_name": "proj",
                                      "experiment_name": "exp-1"}))
    assert run_dir_of(cfg) == tmp_path / "out" / "proj" / "exp-1"


# ---------------------------------------------------------------- the worker's loss functions

_LOG_RATIO = [[0.4, -0.7, 0.0], [0.1, -0.5, 0.26]]  # log(pi / pi_old) per token
_ADV = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
_MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def _actor_loss(tiny, **sections):
    import torch

    from megaflow.megatron.denominators import GlobalDenominators
    from megaflow.workers.losses import actor_loss_fn

    old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -1.2, -2.2]])
    log_probs = old + torch.tensor(_LOG_RATIO)
    mb = {"response_mask": torch.tensor(_MASK), "old_log_probs": old, "advantages": torch.tensor(_ADV),
          "ref_log_probs": old - 0.3}
    outputs = {"log_probs": log_probs, "entropy": torch.tensor([[0.5, 1.0, 1.5], [2.0, 2.5, 9.0]])}
    loss, _ = actor_loss_fn(run_from_dict(tiny(**sections)))(outputs, mb, GlobalDenominators(5, 2))
    return float(loss)


def _ppo_tokens(low, high):
    """Clipped surrogate per token, by hand: max(-A r, -A clip(r, 1 - low, 1 + high))."""
    import math

    return [[max(-a * math.exp(x), -a * min(max(math.exp(x), 1 - low), 1 + high)) for x, a in zip(xs, advs)]
            for xs, advs in zip(_LOG_RATIO, _ADV)]


def _token_mean(values):
    return sum(v * m for row, mrow in zip(values, _MASK) for v, m in zip(row, mrow)) / 5


def test_actor_loss_keys_change_the_worker_loss(tiny):
    import math

    base = _actor_loss(tiny)
    assert base == pytest.approx(_token_mean(_ppo_tokens(0.2, 0.2)), rel=1e-5)
    # actor.clip_ratio_low / clip_ratio_high move the clip band
    assert _actor_loss(tiny, actor={"clip_ratio_low": 0.5}) == pytest.approx(_token_mean(_ppo_tokens(0.5, 0.2)), rel=1e-5)
    assert _actor_loss(tiny, actor={"clip_ratio_high": 0.6}) == pytest.approx(_token_mean(_ppo_tokens(0.2, 0.6)), rel=1e-5)
    assert len({base, _actor_loss(tiny, actor={"clip_ratio_low": 0.5}), _actor_loss(tiny, actor={"clip_ratio_high": 0.6})}) == 3
    # actor.loss_agg_mode: the mean over sequences of each sequence's token mean
    per_seq = [sum(v * m for v, m in zip(row, mrow)) / sum(mrow) for row, mrow in zip(_ppo_tokens(0.2, 0.2), _MASK)]
    assert _actor_loss(tiny, actor={"loss_agg_mode": "seq-mean-token-mean"}) == pytest.approx(sum(per_seq) / 2, rel=1e-5)
    # actor.entropy_coeff: minus coeff x the token-mean entropy
    entropy = _token_mean([[0.5, 1.0, 1.5], [2.0, 2.5, 9.0]])
    assert _actor_loss(tiny, actor={"entropy_coeff": 0.1}) == pytest.approx(base - 0.1 * entropy, rel=1e-5)
    # algorithm.kl_loss_type (with use_kl_loss, kl_loss_coef): k1 = log pi - log ref; low_var_kl = k3 of ref/pi
    log_ratio_ref = [[x + 0.3 for x in row] for row in _LOG_RATIO]  # log pi - log ref
    k1 = _token_mean(log_ratio_ref)
    k3 = _token_mean([[math.exp(-d) + d - 1 for d in row] for row in log_ratio_ref])
    kl = {"use_kl_loss": True, "kl_loss_coef": 0.5}
    ref = {"enabled": True}
    assert _actor_loss(tiny, algorithm={**kl, "kl_loss_type": "k1"}, ref=ref) == pytest.approx(base + 0.5 * k1, rel=1e-5)
    assert _actor_loss(tiny, algorithm={**kl, "kl_loss_type": "low_var_kl"}, ref=ref) == pytest.approx(
        base + 0.5 * k3, rel=1e-5)


def _valid_tokens():
    return [(b, t) for b in range(2) for t in range(3) if _MASK[b][t]]


def _log_prob(b, t):
    return [[-1.0, -2.0, -1.5], [-0.5, -1.2, -2.2]][b][t] + _LOG_RATIO[b][t]


def test_policy_loss_family_keys_change_the_worker_loss(tiny):
    import math

    # actor.dro_beta: -(A log p - beta / 2 x^2) per token
    dro = {"policy_loss": "dro", "clip_ratio_c": None}
    for beta in (0.1, 0.5):
        expected = sum(-(_ADV[b][t] * _log_prob(b, t) - beta / 2 * _LOG_RATIO[b][t] ** 2) for b, t in _valid_tokens())
        assert _actor_loss(tiny, actor={**dro, "dro_beta": beta}) == pytest.approx(expected / 5, rel=1e-5)
    # actor.tau_pos / tau_neg: -A (4 / tau) sigmoid(tau (r - 1)), seq-mean-token-mean
    sapo = {"policy_loss": "sapo", "clip_ratio_c": None, "loss_agg_mode": "seq-mean-token-mean"}

    def sapo_by_hand(tau_pos, tau_neg):
        total = 0.0
        for b, t in _valid_tokens():
            tau = tau_pos if _ADV[b][t] > 0 else tau_neg
            gate = 4 / tau / (1 + math.exp(-tau * (math.exp(_LOG_RATIO[b][t]) - 1)))
            total += -_ADV[b][t] * gate / sum(_MASK[b]) / 2
        return total

    for taus in ((1.0, 1.05), (2.0, 1.05), (1.0, 3.0)):
        assert _actor_loss(tiny, actor={**sapo, "tau_pos": taus[0], "tau_neg": taus[1]}) == pytest.approx(
            sapo_by_hand(*taus), rel=1e-5)
    # actor.kl_cov_ratio / ppo_kl_coef: -A r, plus coef |x| on the top floor(ratio * 5) covariance tokens
    tokens = _valid_tokens()
    mean_a = sum(_ADV[b][t] for b, t in tokens) / 5
    mean_lp = sum(_log_prob(b, t) for b, t in tokens) / 5
    ranked = sorted(tokens, key=lambda k: (_ADV[k[0]][k[1]] - mean_a) * (_log_prob(*k) - mean_lp), reverse=True)

    def kl_cov_by_hand(n_top, coef):
        return sum(-_ADV[b][t] * math.exp(_LOG_RATIO[b][t]) + ((b, t) in ranked[:n_top]) * coef * abs(_LOG_RATIO[b][t])
                   for b, t in tokens) / 5

    kl_cov = {"policy_loss": "kl_cov", "clip_ratio_c": None}
    assert _actor_loss(tiny, actor=kl_cov) == pytest.approx(kl_cov_by_hand(1, 0.1), rel=1e-5)
    assert _actor_loss(tiny, actor={**kl_cov, "ppo_kl_coef": 1.0}) == pytest.approx(kl_cov_by_hand(1, 1.0), rel=1e-5)
    assert _actor_loss(tiny, actor={**kl_cov, "kl_cov_ratio": 0.8}) == pytest.approx(kl_cov_by_hand(4, 0.1), rel=1e-5)
    # actor.clip_cov_ratio / lb / ub: the 3 tokens PPO's clip leaves active all fall in [-10, 10] and
    # floor(0.99 * 5) = 4 >= 3 of them are cut: only the two clipped tokens remain, (-1.2 + 0.8) / 5
    clip_cov = {"policy_loss": "clip_cov", "clip_ratio_c": None}
    wide = {**clip_cov, "clip_cov_ratio": 0.99, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}
    assert _actor_loss(tiny, actor=wide) == pytest.approx(-0.4 / 5, rel=1e-5)
    ppo = _token_mean(_ppo_tokens(0.2, 0.2))
    assert _actor_loss(tiny, actor={**wide, "clip_cov_ub": -9.0}) == pytest.approx(ppo, rel=1e-5)  # band empty
    assert _actor_loss(tiny, actor={**wide, "clip_cov_lb": 1.0}) == pytest.approx(ppo, rel=1e-5)  # |cov| < 1 here
    # one token (of the three, drawn at random) cut: never the -0.08 of all three
    assert _actor_loss(tiny, actor={**wide, "clip_cov_ratio": 0.0002}) != pytest.approx(-0.4 / 5, abs=1e-3)


def test_bypass_loss_recomputes_weights_and_rejection_in_the_worker_loss(tiny):
    import math

    tokens = _valid_tokens()
    w = {(b, t): min(math.exp(_LOG_RATIO[b][t]), 2.0) for b, t in tokens}
    # token_k1 = -x in [log 0.6, log 1.5]: x = -0.7 and -0.5 are rejected, the other three kept
    kept = [(b, t) for b, t in tokens if math.log(0.6) <= -_LOG_RATIO[b][t] <= math.log(1.5)]
    assert kept == [(0, 0), (0, 2), (1, 0)]

    def bypass(**rc):
        return _actor_loss(tiny, algorithm={"rollout_correction": {"bypass": True, **rc}})

    reinforce = {"bypass_loss_type": "reinforce", "is_level": "token", "is_threshold": 2.0}
    # -A log p w on the kept tokens over the 5 tokens of the engine's (pre-rejection) denominator
    assert bypass(**reinforce) == pytest.approx(
        sum(-_ADV[b][t] * _log_prob(b, t) * w[(b, t)] for b, t in tokens) / 5, rel=1e-5)
    assert bypass(**reinforce, rs="token_k1", rs_threshold="0.6_1.5") == pytest.approx(
        sum(-_ADV[b][t] * _log_prob(b, t) * w[(b, t)] for b, t in kept) / 5, rel=1e-5)
    mean_w = sum(w.values()) / 5  # is_batch_normalize: over the micro-batch's valid tokens
    assert bypass(**reinforce, is_batch_normalize=True) == pytest.approx(
        sum(-_ADV[b][t] * _log_prob(b, t) * w[(b, t)] / mean_w for b, t in tokens) / 5, rel=1e-5)
    # ppo_clip: PPO on the kept tokens, no IS weight (the ratio pi / pi_rollout already is one)
    ppo = _ppo_tokens(0.2, 0.2)
    assert bypass(is_level="token", rs="token_k1", rs_threshold="0.6_1.5") == pytest.approx(
        sum(ppo[b][t] for b, t in kept) / 5, rel=1e-5)


@pytest.mark.parametrize("actor, key, related", [
    ({"tau_pos": 2.0}, "actor.tau_pos", "actor.policy_loss"),
    ({"policy_loss": "gpg"}, "actor.clip_ratio_c", "actor.policy_loss"),
    ({"policy_loss": "sapo", "clip_ratio_c": None}, "actor.loss_agg_mode", "actor.policy_loss"),
    ({"policy_loss": "geo_mean", "clip_ratio_c": None, "loss_agg_mode": "seq-mean-token-sum"}, "actor.loss_agg_mode",
     "actor.policy_loss"),
    ({"policy_loss": "dro", "clip_ratio_c": None, "clip_ratio_high": 0.28}, "actor.clip_ratio_high",
     "actor.policy_loss"),
    ({"policy_loss": "clip_cov", "clip_ratio_c": None, "clip_cov_lb": 6.0}, "actor.clip_cov_lb", "actor.clip_cov_ub"),
    ({"policy_loss": "gspo", "_rc": {"bypass": True, "is_level": "token"}}, "actor.policy_loss",
     "algorithm.rollout_correction.bypass"),
    ({"_rc": {"bypass_loss_type": "reinforce"}}, "algorithm.rollout_correction.bypass_loss_type",
     "algorithm.rollout_correction.bypass"),
])
def test_policy_loss_keys_a_loss_cannot_take_are_refused_naming_both(tiny, actor, key, related):
    actor = dict(actor)
    rc = actor.pop("_rc", {})
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor=actor, algorithm={"rollout_correction": rc}))
    assert err.value.key == key and related in str(err.value)


def test_critic_loss_keys_change_the_worker_value_loss(tiny):
    import torch

    from megaflow.megatron.denominators import GlobalDenominators
    from megaflow.workers.losses import critic_loss_fn

    old = [[0.0, 1.0, 2.0], [0.5, -0.5, 0.0]]
    new = [[0.8, 1.1, 1.0], [0.5, 0.4, 3.0]]
    returns = [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]]
    mb = {"response_mask": torch.tensor(_MASK), "values": torch.tensor(old), "returns": torch.tensor(returns)}

    def loss(**critic):
        tree = tiny(critic={"enabled": True, **critic}, algorithm={"adv_estimator": "gae"})
        out, _ = critic_loss_fn(run_from_dict(tree))({"values": torch.tensor(new)}, mb, GlobalDenominators(5, 2))
        return float(out)

    def by_hand(clip):
        """0.5 max((v - R)^2, (old + clip(v - old, -c, c) - R)^2) per token (PPO value clipping)."""
        return [[0.5 * max((v - r) ** 2, (o + min(max(v - o, -clip), clip) - r) ** 2)
                 for v, o, r in zip(vs, os_, rs)] for vs, os_, rs in zip(new, old, returns)]

    # critic.cliprange_value
    assert loss() == pytest.approx(_token_mean(by_hand(0.5)), rel=1e-5)
    assert loss(cliprange_value=0.2) == pytest.approx(_token_mean(by_hand(0.2)), rel=1e-5) != loss()
    # critic.loss_agg_mode
    per_seq = [sum(v * m for v, m in zip(row, mrow)) / sum(mrow) for row, mrow in zip(by_hand(0.5), _MASK)]
    assert loss(loss_agg_mode="seq-mean-token-mean") == pytest.approx(sum(per_seq) / 2, rel=1e-5)


# ---------------------------------------------------------------- what each role's engine is given


def test_micro_batch_keys_and_token_budgets_reach_each_roles_engine(tiny):
    from megaflow.topology.role_spec import RoleSpec

    tree = tiny(actor={"log_prob_micro_batch_size_per_gpu": 3, "ppo_micro_batch_size_per_gpu": 2},
                critic={"enabled": True, "ppo_micro_batch_size_per_gpu": 2, "forward_micro_batch_size_per_gpu": 5,
                        "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 3000,
                        "forward_max_token_len_per_gpu": 4000},
                ref={"enabled": True, "log_prob_micro_batch_size_per_gpu": 6, "use_dynamic_bsz": True,
                     "log_prob_max_token_len_per_gpu": 5000},
                reward_model={"enabled": True, "micro_batch_size_per_gpu": 7},
                algorithm={"adv_estimator": "gae", "use_kl_loss": True})
    tree["reward_model"]["hf_config"] = dict(tree["model"]["hf_config"])
    cfg = run_from_dict(tree)
    sizes = {role: RoleSpec(cfg, role, 1).micro_batches for role in ("actor", "critic", "ref", "reward_model")}
    got = {role: (s.update_micro_batch_size, s.forward_micro_batch_size, s.update_max_tokens, s.forward_max_tokens)
           for role, s in sizes.items()}
    assert got == {"actor": (2, 3, None, None), "critic": (2, 5, 3000, 4000), "ref": (None, 6, None, 5000),
                   "reward_model": (None, 7, None, None)}


def test_critic_recompute_keys_reach_the_critic_model(tiny):
    from megaflow.topology.role_spec import RoleSpec

    cfg = run_from_dict(tiny(critic={"enabled": True, "recompute_granularity": "full", "recompute_method": "block",
                                     "recompute_num_layers": 2}, algorithm={"adv_estimator": "gae"}))
    assert RoleSpec(cfg, "critic", 1).model_overrides == dict(
        sequence_parallel=False, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert RoleSpec(cfg, "actor", 1).model_overrides == dict(sequence_parallel=False)  # the actor's keys unchanged
    selective = run_from_dict(tiny(critic={"enabled": True, "recompute_granularity": "selective"},
                                   algorithm={"adv_estimator": "gae"}))
    assert RoleSpec(selective, "critic", 1).model_overrides["recompute_granularity"] == "selective"


def test_the_reward_model_reads_its_own_checkpoint_and_a_critic_enables_its_group(tiny, tmp_path):
    from megaflow.topology.sizes import enabled_roles, model_source

    hf = dict(tiny()["model"]["hf_config"])
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf))
    cfg = run_from_dict(tiny(reward_model={"enabled": True, "path": str(tmp_path)}))
    source = model_source(cfg, "reward_model")
    assert (source.path, source.key) == (str(tmp_path), "reward_model.path")
    assert model_source(cfg, "actor").key == "model.hf_config"
    assert enabled_roles(cfg) == ("actor", "reward_model")
    with_critic = run_from_dict(tiny(critic={"enabled": True}, algorithm={"adv_estimator": "gae"}))
    assert enabled_roles(with_critic) == ("actor", "critic")  # critic.enabled starts a critic group


def test_ref_and_reward_model_placement_choose_their_pool(tiny):
    from megaflow.topology.sizes import role_parallel

    tree = tiny(resources={"use_gpu": False, "procs_per_node": 6,
                           "pools": {"global": {"procs_per_node": 2}, "side": {"procs_per_node": 4}},
                           "placement": {"ref": "side", "reward_model": "side"}},
                ref={"enabled": True}, reward_model={"enabled": True}, algorithm={"use_kl_loss": True})
    tree["reward_model"]["hf_config"] = dict(tree["model"]["hf_config"])
    cfg = run_from_dict(tree)
    # world size = the pool's ranks; dp = world / (tp * pp * cp)
    assert (role_parallel(cfg, "actor").world_size, role_parallel(cfg, "actor").dp) == (2, 2)
    assert (role_parallel(cfg, "ref").world_size, role_parallel(cfg, "ref").dp) == (4, 4)
    assert (role_parallel(cfg, "reward_model").world_size, role_parallel(cfg, "reward_model").dp) == (4, 4)


def test_the_cluster_wait_is_bounded_by_ray_resource_wait_timeout_s(tiny, monkeypatch):
    import ray

    import megaflow.launch.auth
    import megaflow.launch.cluster

    waits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    inits = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    monkeypatch.setattr(trainer_main, "_started_ray", False)
    monkeypatch.setattr(megaflow.launch.auth, "enable_token_auth", lambda: None)
    monkeypatch.setattr(megaflow.launch.cluster, "wait_for_cluster",
                        lambda need, timeout, address: waits.append((timeout, address)))
    trainer_main.init_ray(run_from_dict(tiny(ray={"address": "10.0.0.1:6379", "resource_wait_timeout_s": 12.5})))
    assert waits == [(12.5, "10.0.0.1:6379")]
    # a cluster's workers do not inherit this process's environment: it travels as the job's runtime_env
    assert inits[0]["runtime_env"] == {"env_vars": trainer_main.worker_env()}


def test_validation_files_become_the_validation_dataset(tmp_path, tiny, arith_rows):
    tok = build_arith_tokenizer()
    train = write_rows(arith_rows["train"], tmp_path / "train.jsonl")
    val = write_rows(arith_rows["val"], tmp_path / "val.jsonl")
    cfg = run_from_dict(_files_tree(tiny, train, val, max_prompt_length=64))
    assert cfg.data.val_files == (str(val),)
    assert load_datasets(cfg, tok).val_dataset is None  # data.val_files without a test cadence: not read
    cadence = _files_tree(tiny, train, val, max_prompt_length=64)
    cadence["trainer"] = {"test_freq": 5}
    val_dataset = load_datasets(run_from_dict(cadence), tok).val_dataset
    assert len(val_dataset) == len(arith_rows["val"]) and val_dataset.records[0].ground_truth is not None


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_optimizer_keys_reach_megatron_cores_optimizer(tiny, role, monkeypatch):
    """The engine hands ``<role>.optim`` and ``use_distributed_optimizer`` to megatron-core's
    ``OptimizerConfig`` / DDP config (megatron-core's Adam then implements them); megatron's
    optimizer and DDP wrapper are replaced by recorders so no process group is needed."""
    from types import SimpleNamespace

    import megatron.core.distributed as mcd
    import megatron.core.optimizer as mco
    import megatron.core.optimizer_param_scheduler as mcs
    import torch

    from megaflow.megatron.engine import MegatronEngine
    from megaflow.topology.role_spec import RoleSpec

    seen = {}
    monkeypatch.setattr(mcd, "DistributedDataParallel",
                        lambda config, ddp_config, module: seen.update(ddp=ddp_config) or SimpleNamespace(
                            no_sync=None, config=config))
    monkeypatch.setattr(mco, "get_megatron_optimizer",
                        lambda config, models: seen.update(optim=config) or SimpleNamespace(scale_loss=None))
    monkeypatch.setattr(mcs, "OptimizerParamScheduler", lambda optimizer, **kwargs: seen.update(schedule=kwargs))
    optim = {"lr": 2e-5, "betas": [0.8, 0.95], "eps": 1e-5, "weight_decay": 0.2, "clip_grad": 0.5}
    sections = {role: {"optim": optim, "use_distributed_optimizer": False}}
    if role == "critic":
        sections.update(critic={"enabled": True, **sections["critic"]}, algorithm={"adv_estimator": "gae"})
    spec = RoleSpec(run_from_dict(tiny(**sections)), role, 10)
    engine = MegatronEngine.__new__(MegatronEngine)
    engine.spec = spec
    engine.model = SimpleNamespace(config=SimpleNamespace(bf16=False, fp16=False, params_dtype=torch.float32))
    engine._setup_training()
    o = seen["optim"]
    assert (o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps) == (2e-5, 0.8, 0.95, 1e-5)
    assert (o.weight_decay, o.clip_grad, o.use_distributed_optimizer) == (0.2, 0.5, False)
    assert seen["ddp"].use_distributed_optimizer is False
    assert seen["schedule"]["start_wd"] == seen["schedule"]["end_wd"] == 0.2
    default = RoleSpec(run_from_dict(tiny(**({"critic": {"enabled": True}, "algorithm": {"adv_estimator": "gae"}}
                                             if role == "critic" else {}))), role, 10)
    engine.spec = default
    engine._setup_training()
    assert default.parallel.dp == 2  # null (the default): the distributed optimizer exactly when dp > 1
    assert (seen["optim"].adam_beta1, seen["optim"].use_distributed_optimizer) == (0.9, True)
    assert seen["ddp"].use_distributed_optimizer is True
    one_dp = {"actor": {"tp": 2}, **({"critic": {"enabled": True, "tp": 2}, "algorithm": {"adv_estimator": "gae"}}
                                     if role == "critic" else {})}
    engine.spec = RoleSpec(run_from_dict(tiny(**one_dp)), role, 10)
    assert engine.spec.parallel.dp == 1
    engine._setup_training()
    assert seen["optim"].use_distributed_optimizer is False and seen["ddp"].use_distributed_optimizer is False
    forced = {**one_dp, role: {**one_dp[role], "use_distributed_optimizer": True}}
    engine.spec = RoleSpec(run_from_dict(tiny(**forced)), role, 10)
    engine._setup_training()
    assert seen["optim"].use_distributed_optimizer is True


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_ppo_epochs_repeat_the_mini_batch_steps_of_an_update(tiny, role):
    """``<role>.ppo_epochs`` passes over a rank's rows, each cut into mini-batches of
    ``ppo_mini_batch_size x rollout.n / dp`` rows: epochs x mini-batches optimizer steps
    (the worker's update loop with a recording engine)."""
    from types import SimpleNamespace

    import torch

    from megaflow.protocol import DataProto
    from megaflow.topology.role_spec import RoleSpec
    from megaflow.workers.megatron_role import MegatronRole

    def steps_of(epochs):
        section = {"ppo_epochs": epochs, "ppo_mini_batch_size": 4, **({"shuffle": False} if role == "actor" else {})}
        extra = {"critic": {"enabled": True, **section}, "algorithm": {"adv_estimator": "gae"}} if role == "critic" \
            else {"actor": section}
        spec = RoleSpec(run_from_dict(tiny(**extra)), role, 1)
        minis = []
        model = MegatronRole(spec)
        model.info = SimpleNamespace(dp_rank=0)
        model.engine = SimpleNamespace(scheduler=SimpleNamespace(num_steps=0), offloaded=frozenset(),
                                       left_align=lambda tensors: SimpleNamespace(
                                           take=lambda index: {"row": tensors["row"][index]}),
                                       train_step=lambda mini, loss_fn: minis.append(mini["row"].tolist())
                                       or {"loss": 1.0})
        model.update(DataProto.from_dict({"row": torch.arange(64)}), loss_fn=None)
        return minis

    # 16 prompts x 8 samples over dp=2: 64 rows per rank; mini-batches of 4 x 8 / 2 = 16 rows
    one, three = steps_of(1), steps_of(3)
    assert one == [list(range(i, i + 16)) for i in range(0, 64, 16)]
    assert len(three) == 3 * 4 and sorted(sum(three, [])) == sorted(list(range(64)) * 3)


# ---------------------------------------------------------------- the controller's stages


def test_kl_penalty_picks_the_estimator_of_the_reward_stage(tiny):
    import math
    from types import SimpleNamespace

    import torch

    from megaflow.algorithms.kl import build_kl_controller
    from megaflow.protocol import DataProto
    from megaflow.trainer.ppo_trainer import KL_STAGES

    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    diff = [[0.3, -0.2], [0.1, 0.4]]  # log pi_old - log pi_ref
    scores = [[0.0, 1.0], [0.0, 0.5]]
    beta = 0.5

    def rewards(kind):
        cfg = run_from_dict(tiny(algorithm={"use_kl_in_reward": True, "kl_penalty": kind,
                                            "kl_ctrl": {"kl_coef": beta}}, ref={"enabled": True}))
        k = cfg.algorithm.kl_ctrl
        trainer = SimpleNamespace(cfg=cfg, kl_ctrl=build_kl_controller(k.type, kl_coef=k.kl_coef))
        batch = DataProto.from_dict({"token_level_scores": torch.tensor(scores), "old_log_probs": old,
                                     "ref_log_probs": old - torch.tensor(diff), "response_mask": torch.ones(2, 2)})
        out, _ = KL_STAGES[cfg.algorithm.use_kl_in_reward](trainer, batch)
        return sum(out.batch["token_level_rewards"].tolist(), [])

    k1 = [s - beta * d for srow, drow in zip(scores, diff) for s, d in zip(srow, drow)]
    k3 = [s - beta * (math.exp(-d) + d - 1) for srow, drow in zip(scores, diff) for s, d in zip(srow, drow)]
    assert rewards("k1") == pytest.approx(k1, rel=1e-5) and rewards("k3") == pytest.approx(k3, rel=1e-5)


def test_is_threshold_truncates_the_rollout_correction_weights(tiny):
    import math

    import torch

    from megaflow.protocol import DataProto
    from megaflow.trainer.stages import rollout_correction

    old, rollout = [[-1.0, -0.2, -3.0]], [[-2.0, -0.1, -3.5]]  # delta = 1.0, -0.1, 0.5
    batch = DataProto.from_dict({"old_log_probs": torch.tensor(old), "rollout_log_probs": torch.tensor(rollout),
                                 "response_mask": torch.ones(1, 3)})

    def weights(threshold):
        cfg = run_from_dict(tiny(algorithm={"rollout_correction": {"is_level": "token", "is_threshold": threshold}}))
        out, _ = rollout_correction(batch, cfg.algorithm.rollout_correction, step=0)
        return out.batch["rollout_is_weights"].tolist()[0]

    raw = [math.exp(o - r) for o, r in zip(old[0], rollout[0])]
    assert weights(2.0) == pytest.approx([min(w, 2.0) for w in raw], rel=1e-6)
    assert weights(1.5) == pytest.approx([min(w, 1.5) for w in raw], rel=1e-6)  # two weights truncated


def test_model_dtype_sizes_the_planned_parameter_memory(tiny):
    from megaflow.dryrun import build_plan
    from megaflow.topology.model_spec import stage_parameters

    for dtype, nbytes in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        plan = build_plan(run_from_dict(tiny(model={"dtype": dtype})))
        actor = plan.role("actor")
        per_rank = stage_parameters(actor.model, tp=actor.parallel.tp, pp=actor.parallel.pp)[0]
        assert plan.dtype == dtype and actor.memory.params == per_rank * nbytes


def test_val_do_sample_makes_validation_sample_instead_of_decoding_greedily(tiny):
    from types import SimpleNamespace

    import torch

    from megaflow.protocol import DataProto
    from megaflow.trainer.ppo_trainer import RayPPOTrainer

    def greedy_flags(**rollout):
        flags = []
        prompts = DataProto.from_dict({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
        trainer = SimpleNamespace(
            cfg=run_from_dict(tiny(rollout=rollout)), val_loader=[prompts], rollouts=SimpleNamespace(sync=lambda: None),
            rollout=lambda batch, n, greedy: flags.append((n, greedy)) or batch,
            score=lambda batch, keep_reward_fields: DataProto.from_dict(
                {"token_level_scores": torch.tensor([[1.0, 0.0], [0.0, 0.0]])}))
        metrics = RayPPOTrainer.validate(trainer)
        assert metrics["val/score/mean"] == pytest.approx(0.5)
        return flags

    assert greedy_flags() == [(1, True)]  # rollout.val_do_sample false: greedy
    assert greedy_flags(val_do_sample=True) == [(1, False)]


def _advantages_of_a_step(cfg, seq_scores, values=None):
    """``advantages`` that ``RayPPOTrainer.train_step`` hands to the actor's update (and
    ``returns``, to the critic's), on a stand-in trainer: 2 prompts x 2 samples, prompts and responses 2 tokens,
    each sequence's score on its last token (``values`` ``[4, 2]``: the critic's)."""
    from types import SimpleNamespace

    import torch

    from megaflow.protocol import DataProto
    from megaflow.trainer.ppo_trainer import RayPPOTrainer
    from megaflow.trainer.rollout_source import SyncReport
    from megaflow.workers.weight_sync import WeightSync

    b, r = 4, 2
    prompts, responses = torch.tensor([[5, 6]] * b), torch.tensor([[7, 8], [8, 7], [7, 7], [8, 8]])
    batch = DataProto.from_dict(
        {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], -1),
         "attention_mask": torch.ones(b, 4, dtype=torch.long), "position_ids": torch.arange(4).repeat(b, 1),
         "response_mask": torch.ones(b, r, dtype=torch.long), "rollout_log_probs": torch.zeros(b, r)},
        {"uid": ["p0", "p0", "p1", "p1"]})
    scores = torch.zeros(b, r)
    scores[:, -1] = torch.tensor(seq_scores)
    seen = {}

    def update(data):
        seen.update(advantages=data.batch["advantages"].tolist())
        return [{}]

    def update_critic(data):
        seen.update(returns=data.batch["returns"].tolist())
        return [{}]

    synced = [WeightSync(0, 0, 0)]
    actor = SimpleNamespace(compute_log_prob=lambda data: DataProto.from_dict({"old_log_probs": torch.zeros(b, r)}),
                            update_actor=update, sync_rollout_weights=lambda verify=False, bucket_mb=None: synced)
    critic = None if values is None else SimpleNamespace(
        compute_values=lambda data: DataProto.from_dict({"values": torch.tensor(values)}),
        update_critic=update_critic)
    trainer = SimpleNamespace(
        cfg=cfg, groups=SimpleNamespace(actor=actor, ref=None, reference=None, critic=critic, cost_critic=None),
        global_step=0, safe=None,
        rollouts=SimpleNamespace(sync=lambda: SyncReport(0, {}), next_batch=lambda step: (batch, {}),
                                 correction=lambda: cfg.algorithm.rollout_correction),
        score=lambda data: data.union(DataProto.from_dict({"token_level_scores": scores})))
    RayPPOTrainer.train_step(trainer)
    return seen


def test_norm_adv_by_std_divides_group_centred_scores_by_the_group_std(tiny):
    import statistics

    scores = [1.0, 0.0, 3.0, 1.0]
    plain = _advantages_of_a_step(run_from_dict(tiny(algorithm={"norm_adv_by_std": False})), scores)
    normed = _advantages_of_a_step(run_from_dict(tiny()), scores)
    centred = [0.5, -0.5, 1.0, -1.0]  # minus each prompt's mean score
    stds = [statistics.stdev([1.0, 0.0])] * 2 + [statistics.stdev([3.0, 1.0])] * 2  # unbiased (Shao et al. 2024)
    assert [row[0] for row in plain["advantages"]] == pytest.approx(centred)
    assert [row[0] for row in normed["advantages"]] == pytest.approx([c / (s + 1e-6) for c, s in zip(centred, stds)])


def test_gamma_and_lam_shape_the_gae_advantages(tiny):
    values = [[0.5, 0.2], [0.1, 0.4], [0.3, 0.3], [0.0, 0.6]]
    scores = [1.0, 0.0, 2.0, -1.0]

    def gae_by_hand(gamma, lam):
        """delta_t = r_t + gamma V_{t+1} - V_t (V after the last token 0); A_t = delta_t + gamma lam A_{t+1}."""
        out = []
        for v, s in zip(values, scores):
            rewards, adv, nxt_v, nxt_a = [0.0, s], [0.0, 0.0], 0.0, 0.0
            for t in (1, 0):
                delta = rewards[t] + gamma * nxt_v - v[t]
                adv[t] = nxt_a = delta + gamma * lam * nxt_a
                nxt_v = v[t]
            out.append(adv)
        return out

    for gamma, lam in ((1.0, 1.0), (0.9, 0.8), (0.5, 0.0)):
        cfg = run_from_dict(tiny(algorithm={"adv_estimator": "gae", "gamma": gamma, "lam": lam,
                                            "norm_adv_by_std": False}, critic={"enabled": True}))
        got = _advantages_of_a_step(cfg, scores, values)
        expected = gae_by_hand(gamma, lam)
        assert sum(got["advantages"], []) == pytest.approx(sum(expected, []), rel=1e-5, abs=1e-6)
        assert sum(got["returns"], []) == pytest.approx([a + v for ea, va in zip(expected, values)
                                                         for a, v in zip(ea, va)], rel=1e-5, abs=1e-6)


def test_trainer_logger_picks_the_runs_metric_sinks(tiny, tmp_path, monkeypatch):
    """``train`` with the worker groups and the controller replaced by stand-ins: the run's
    ``Tracking`` writes ``metrics.jsonl`` only with the jsonl sink, tensorboard events only
    with the tensorboard sink."""
    from types import SimpleNamespace

    import megaflow.trainer.ppo_trainer as ppo
    import megaflow.trainer.roles as roles
    from megaflow.utils.tracking import read_metrics_jsonl

    made = []
    monkeypatch.setattr(trainer_main, "init_ray", lambda cfg: None)
    monkeypatch.setattr(roles, "build_worker_groups", lambda cfg, tokenizer, steps: SimpleNamespace())
    monkeypatch.setattr(roles, "shutdown_worker_groups", lambda groups: None)
    monkeypatch.setattr(ppo, "RayPPOTrainer", lambda cfg, groups, reward_fn, train, val, tracker, ckpt, **kw:
                        made.append(sorted(tracker.backends)) or SimpleNamespace(tracker=tracker))

    def fit(trainer, groups, total_steps):
        trainer.tracker.log({"critic/score/mean": 0.25}, step=1)
        return {}

    monkeypatch.setattr(trainer_main, "_fit_naming_lost_workers", fit)

    def run(name, loggers):
        cfg = run_from_dict(tiny(trainer={"output_dir": str(tmp_path), "experiment_name": name,
                                          "logger": loggers, "total_steps": 1}))
        trainer_main.train(cfg)
        return tmp_path / "megaflow" / name

    jsonl = run("sinks-jsonl", ["jsonl"])
    assert [r["critic/score/mean"] for r in read_metrics_jsonl(jsonl / "metrics.jsonl")] == [0.25]
    assert not (jsonl / "tensorboard").exists()
    board = run("sinks-tb", ["console", "tensorboard"])
    assert not (board / "metrics.jsonl").exists() and any((board / "tensorboard").iterdir())
    assert made == [["jsonl"], ["console", "tensorboard"]]
