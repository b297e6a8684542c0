"""The typed role proxies list exactly the worker classes' registered methods (each with an
asynchronous twin where it has one), and send each call only the fields it declares."""
from __future__ import annotations

import inspect

import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.decorator import registered_methods
from megaflow.trainer import proxies as api


def _worker_classes():
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from megaflow.workers.megatron_workers import CriticWorker, RefWorker, RewardModelWorker
    from megaflow.workers.rollout_worker import RolloutWorker, SplitActorWorker

    # the actor's proxy serves both actor workers: with engines, and without (split placement)
    return {api.ActorProxy: (ActorRolloutWorker, SplitActorWorker), api.RolloutProxy: (RolloutWorker,),
            api.RefProxy: (RefWorker,), api.CriticProxy: (CriticWorker,), api.RewardModelProxy: (RewardModelWorker,)}


def _proxy_methods(proxy: type) -> dict[str, object]:
    return {name: value for name, value in inspect.getmembers(proxy, inspect.isfunction)
            if not name.startswith("_") and name not in api.GROUP_MEMBERS}


def _group_return(spec, worker_return: str) -> str:
    """The return annotation a proxy method has for a worker method's annotation."""
    if spec.is_proto:  # DataProto: the collected rows of all DP ranks (non-collect ranks return None);
        # rows with metrics: the collected rows and each DP rank's metrics; anything else (an
        # update's metrics): one value per DP rank (collect_proto)
        if "ProtoResult" in worker_return:
            return "GroupProtoResult"
        return "DataProto" if "DataProto" in worker_return else f"list[{worker_return}]"
    if spec.execute_mode.name == "RANK_ZERO":
        return worker_return
    return f"list[{worker_return}]"


def _params(fn) -> list[tuple]:
    return [(q.name, q.kind, q.default, q.annotation) for q in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("proxy", list(_worker_classes()), ids=lambda p: p.__name__)
def test_proxy_methods_are_the_registered_worker_methods(proxy):
    workers = _worker_classes()[proxy]
    registered = {}
    for worker in workers:
        registered.update({name: (worker, spec) for name, spec in registered_methods(worker).items()})
    methods = _proxy_methods(proxy)
    blocking = {name: fn for name, fn in methods.items() if not name.endswith("_async")}
    assert sorted(blocking) == sorted(registered), f"{proxy.__name__} vs {[w.__name__ for w in workers]}"
    for name, (worker, spec) in registered.items():
        w = inspect.signature(getattr(worker, name))
        assert _params(blocking[name]) == _params(getattr(worker, name)), f"{proxy.__name__}.{name}"
        assert inspect.signature(blocking[name]).return_annotation == _group_return(spec, w.return_annotation), \
            f"{proxy.__name__}.{name}"
        assert (getattr(blocking[name], "__megaflow_reads__", None) is not None) == spec.is_proto, \
            f"{proxy.__name__}.{name}: batch methods, and only they, declare the fields they read"
    for name, fn in methods.items():
        if not name.endswith("_async"):
            continue
        twin = name.removesuffix("_async")
        assert twin in registered, f"{proxy.__name__}.{name} has no registered twin"
        assert _params(fn) == _params(blocking[twin]), f"{proxy.__name__}.{name}"
        future = "DataProtoFuture" if registered[twin][1].is_proto else "GroupFuture"
        assert inspect.signature(fn).return_annotation == future, f"{proxy.__name__}.{name}"


class _RecordingGroup:
    """A worker group that records what reaches it (method name, arguments)."""

    def __init__(self):
        self.calls = []

    def call(self, method, *args, **kwargs):
        self.calls.append(("call", method, args, kwargs))
        return method

    def submit(self, method, *args, **kwargs):
        self.calls.append(("submit", method, args, kwargs))
        return method


def test_proxies_run_the_worker_method_with_the_declared_fields():
    rows = 2
    batch = DataProto.from_dict(
        {"input_ids": torch.ones(rows, 5, dtype=torch.long), "attention_mask": torch.ones(rows, 5, dtype=torch.long),
         "position_ids": torch.arange(5).repeat(rows, 1), "responses": torch.ones(rows, 2, dtype=torch.long),
         "values": torch.zeros(rows, 2)},
        {"uid": ["a", "b"]}, {"temperature": 0.7, "seed": 3})
    group = _RecordingGroup()
    actor, rollout = api.ActorProxy(group), api.RolloutProxy(group)
    assert actor.compute_log_prob(batch) == "compute_log_prob"
    assert rollout.generate_sequences_async(batch) == "generate_sequences"
    assert actor.sync_rollout_weights_async(verify=True, bucket_mb=8) == "sync_rollout_weights"
    assert actor.export_hf("/tmp/x") == "export_hf"
    (kind0, _, (sent0,), _), (kind1, _, (sent1,), _), (kind2, _, args2, kw2), (_, _, args3, _) = group.calls
    assert (kind0, sorted(sent0.batch.keys()), sent0.meta_info) == \
        ("call", ["attention_mask", "input_ids", "responses"], {"temperature": 0.7})
    assert (kind1, sorted(sent1.batch.keys()), sent1.non_tensor_batch) == \
        ("submit", ["attention_mask", "input_ids"], {})
    assert sent1.meta_info == {"temperature": 0.7, "seed": 3}
    assert (kind2, args2, kw2) == ("submit", (True, 8), {})
    assert args3 == ("/tmp/x", False)


def test_inputs_for_sends_the_declared_fields_only():
    rows = 3
    batch = DataProto.from_dict(
        {"input_ids": torch.ones(rows, 5, dtype=torch.long), "attention_mask": torch.ones(rows, 5, dtype=torch.long),
         "position_ids": torch.arange(5).repeat(rows, 1), "responses": torch.ones(rows, 2, dtype=torch.long),
         "response_mask": torch.ones(rows, 2), "old_log_probs": torch.zeros(rows, 2),
         "advantages": torch.randn(rows, 2), "token_level_scores": torch.zeros(rows, 2),
         "rollout_is_weights": torch.ones(rows, 2)},
        {"uid": ["a", "a", "b"], "raw_prompt": ["x", "y", "z"]}, {"temperature": 0.7, "rollout_metrics": {}})
    out = api.inputs_for(api.ActorProxy.update_actor, batch)
    assert sorted(out.batch.keys()) == sorted(["input_ids", "attention_mask", "responses", "response_mask",
                                               "old_log_probs", "advantages", "rollout_is_weights"])
    assert out.non_tensor_batch == {} and out.meta_info == {"temperature": 0.7}
    assert out.batch["advantages"].data_ptr() == batch.batch["advantages"].data_ptr()  # shared, not copied
    values = api.inputs_for(api.CriticProxy.compute_values, batch)
    assert sorted(values.batch.keys()) == ["attention_mask", "input_ids", "responses"] and values.meta_info == {}
    with pytest.raises(KeyError, match=r"update_critic reads \['values', 'returns'\]"):
        api.inputs_for(api.CriticProxy.update_critic, batch)
    with pytest.raises(TypeError, match="declares no batch fields"):
        api.inputs_for(api.ActorProxy.sync_rollout_weights, batch)
