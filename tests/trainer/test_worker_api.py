"""The typed role-group protocols list exactly the worker classes' registered methods, and
the controller sends each call only the fields its protocol declares."""
from __future__ import annotations

import inspect

import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.decorator import NDCompute, registered_methods
from megaflow.trainer import worker_api as api


def _worker_classes():
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from megaflow.workers.megatron_workers import CriticWorker, RefWorker, RewardModelWorker
    from megaflow.workers.rollout_worker import RolloutWorker, SplitActorWorker

    return {api.ActorRolloutGroup: ActorRolloutWorker, api.SplitActorGroup: SplitActorWorker,
            api.RolloutGroup: RolloutWorker, api.RefGroup: RefWorker, api.CriticGroup: CriticWorker,
            api.RewardModelGroup: RewardModelWorker}


def _protocol_methods(proto: type) -> dict[str, object]:
    out = {}
    for klass in proto.__mro__:
        for name, value in vars(klass).items():
            if name.startswith("_") or name in api.GROUP_MEMBERS or name in out or not callable(value):
                continue
            out[name] = value
    return out


def _group_return(spec, worker_return: str) -> str:
    """The return annotation a group method has for a worker method's annotation."""
    if spec.is_proto:  # DataProto: the collected rows of all DP ranks (non-collect ranks return None);
        # rows with metrics: the collected rows and each DP rank's metrics; anything else (an
        # update's metrics): one value per DP rank (collect_proto)
        if "ProtoResult" in worker_return:
            return "GroupProtoResult"
        return "DataProto" if "DataProto" in worker_return else f"list[{worker_return}]"
    if isinstance(spec.dispatch_mode, NDCompute):  # pragma: no cover - covered by is_proto
        return "DataProto"
    if spec.execute_mode.name == "RANK_ZERO":
        return worker_return
    return f"list[{worker_return}]"


@pytest.mark.parametrize("proto", list(_worker_classes()), ids=lambda p: p.__name__)
def test_protocol_lists_the_registered_methods_with_their_signatures(proto):
    worker = _worker_classes()[proto]
    registered = registered_methods(worker)
    methods = _protocol_methods(proto)
    assert sorted(methods) == sorted(registered), f"{proto.__name__} vs {worker.__name__}"
    for name, spec in registered.items():
        w = inspect.signature(getattr(worker, name))
        p = inspect.signature(methods[name])
        w_params = [(q.name, q.kind, q.default, q.annotation) for q in list(w.parameters.values())[1:]]
        p_params = [(q.name, q.kind, q.default, q.annotation) for q in list(p.parameters.values())[1:]]
        assert p_params == w_params, f"{proto.__name__}.{name}"
        assert p.return_annotation == _group_return(spec, w.return_annotation), f"{proto.__name__}.{name}"
        assert (getattr(methods[name], "__megaflow_reads__", None) is not None) == spec.is_proto, \
            f"{proto.__name__}.{name}: batch methods, and only they, declare the fields they read"


def test_group_members_are_real_group_attributes():
    from megaflow.single_controller import RayWorkerGroup

    for name in api.GROUP_MEMBERS:
        assert hasattr(RayWorkerGroup, name)
        assert name in vars(api.RoleGroup)


def test_inputs_for_sends_the_declared_fields_only():
    rows = 3
    batch = DataProto.from_dict(
        {"input_ids": torch.ones(rows, 5, dtype=torch.long), "attention_mask": torch.ones(rows, 5, dtype=torch.long),
         "position_ids": torch.arange(5).repeat(rows, 1), "responses": torch.ones(rows, 2, dtype=torch.long),
         "response_mask": torch.ones(rows, 2), "old_log_probs": torch.zeros(rows, 2),
         "advantages": torch.randn(rows, 2), "token_level_scores": torch.zeros(rows, 2),
         "rollout_is_weights": torch.ones(rows, 2)},
        {"uid": ["a", "a", "b"], "raw_prompt": ["x", "y", "z"]}, {"temperature": 0.7, "rollout_metrics": {}})
    out = api.inputs_for(api.ActorRolloutGroup.update_actor, batch)
    assert sorted(out.batch.keys()) == sorted(["input_ids", "attention_mask", "responses", "response_mask",
                                               "old_log_probs", "advantages", "rollout_is_weights"])
    assert out.non_tensor_batch == {} and out.meta_info == {"temperature": 0.7}
    assert out.batch["advantages"].data_ptr() == batch.batch["advantages"].data_ptr()  # shared, not copied
    values = api.inputs_for(api.CriticGroup.compute_values, batch)
    assert sorted(values.batch.keys()) == ["attention_mask", "input_ids", "responses"] and values.meta_info == {}
    with pytest.raises(KeyError, match=r"update_critic reads \['values', 'returns'\]"):
        api.inputs_for(api.CriticGroup.update_critic, batch)
    with pytest.raises(TypeError, match="declares no batch fields"):
        api.inputs_for(api.ActorRolloutGroup.sync_rollout_weights, batch)
