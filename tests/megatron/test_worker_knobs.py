"""Worker knobs that need no process group: the three offload flags and ``actor.shuffle``.

* each offload flag offloads exactly its part of the engine state between phases;
* with ``shuffle`` the rows of a rank are permuted before being cut into mini-batches,
  with a permutation fixed by (seed, optimizer steps so far, epoch, DP rank), so it is
  reproducible across a resume; with one mini-batch (or shuffle off) the order is kept.
* the recipe keys reach what the worker reads (``RoleSpec``).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megaflow.workers.megatron_role import MegatronRole
from role_testlib import role_spec


class _Engine:
    def __init__(self, num_steps: int = 0) -> None:
        self.calls = []
        self.scheduler = SimpleNamespace(num_steps=num_steps)
        self.offloaded = frozenset()

    def offload(self, **parts):
        self.calls.append(parts)


def _worker(num_steps=0, dp_rank=0, seed=1, **actor) -> MegatronRole:
    spec = role_spec("actor", [f"trainer.seed={seed}"] + [f"actor.{k}={str(v).lower()}" for k, v in actor.items()])
    role = MegatronRole(spec)
    role.engine, role.info = _Engine(num_steps), SimpleNamespace(dp_rank=dp_rank)
    return role


@pytest.mark.parametrize("flags", [dict(param_offload=True), dict(grad_offload=True), dict(optimizer_offload=True),
                                   dict(param_offload=True, optimizer_offload=True)])
def test_each_offload_flag_offloads_exactly_its_part(flags):
    worker = _worker(**flags)
    with worker.phase():
        assert worker.engine.calls == []  # offloaded after the phase, not before
    assert worker.engine.calls == [dict(params=flags.get("param_offload", False),
                                        grads=flags.get("grad_offload", False),
                                        optimizer=flags.get("optimizer_offload", False))]


def test_no_offload_flag_offloads_nothing():
    worker = _worker()
    with worker.phase():
        pass
    assert worker.engine.calls == []


def _order(worker, rows=12, per_rank=4, epoch=0):
    return worker.mini_batch_order(rows, per_rank, epoch)


def test_shuffle_permutes_rows_reproducibly_per_step_epoch_and_rank():
    order = _order(_worker(shuffle=True, seed=3))
    assert sorted(order.tolist()) == list(range(12)) and order.tolist() != list(range(12))
    assert torch.equal(order, _order(_worker(shuffle=True, seed=3)))  # same state -> same order (resume)
    others = [_order(_worker(shuffle=True, seed=4)), _order(_worker(num_steps=5, shuffle=True, seed=3)),
              _order(_worker(shuffle=True, seed=3), epoch=1), _order(_worker(dp_rank=1, shuffle=True, seed=3))]
    for other in others:
        assert not torch.equal(order, other)


def test_order_is_kept_without_shuffle_or_with_one_mini_batch():
    assert _order(_worker(shuffle=False)) is None
    assert _order(_worker(shuffle=True), rows=4, per_rank=4) is None


def test_recipe_knobs_reach_the_worker_config():
    spec = role_spec("actor", ["actor.shuffle=false", "actor.grad_offload=true",
                               "actor.recompute_granularity=full", "actor.recompute_num_layers=2"])
    assert spec.shuffle is False and spec.offload == dict(params=False, grads=True, optimizer=False)
    assert spec.model_overrides == dict(sequence_parallel=False, recompute_granularity="full",
                                        recompute_method="uniform", recompute_num_layers=1 * 2)
    default = role_spec("actor")
    assert default.shuffle is True and default.model_overrides == dict(sequence_parallel=False)


class _OffloadableEngine(_Engine):
    """Records reloads, offloads and forward passes; starts with everything offloaded."""

    def __init__(self):
        super().__init__()
        self.offloaded = frozenset({"params", "grads", "optimizer"})

    def reload(self, parts):
        self.calls.append(("reload", tuple(parts)))

    def offload(self, **parts):
        self.calls.append(("offload", parts))

    def forward(self, tensors, **kwargs):
        self.calls.append(("forward", sorted(tensors)))
        return {}


def test_forward_phases_reload_parameters_only_and_every_phase_offloads_after():
    from megaflow.protocol import DataProto

    worker = _worker(param_offload=True)
    worker.engine = _OffloadableEngine()
    worker.forward(DataProto.from_dict({"input_ids": torch.zeros(1, 2, dtype=torch.long)}))
    with pytest.raises(KeyError):  # a phase that fails still offloads
        with worker.phase():
            raise KeyError("x")
    offload = ("offload", dict(params=True, grads=False, optimizer=False))
    assert worker.engine.calls == [("reload", ("params",)), ("forward", ["input_ids"]), offload,
                                   ("reload", ("params", "grads", "optimizer")), offload]


def test_a_worker_refuses_the_spec_of_another_role():
    from megaflow.workers.actor_rollout import ActorRolloutWorker
    from megaflow.workers.megatron_workers import CriticWorker, RefWorker

    actor = role_spec("actor")
    with pytest.raises(ValueError, match="RefWorker serves the 'ref' role, got a RoleSpec of 'actor'"):
        RefWorker(actor)
    with pytest.raises(TypeError, match="spec must be a megaflow.topology.role_spec.RoleSpec, got dict"):
        CriticWorker({"role": "critic"})
    from megaflow.workers.rollout_host import stop_token_ids

    worker = ActorRolloutWorker(role_spec("actor", ["rollout.ignore_eos=true"]), (0, 5), 0)
    assert stop_token_ids(worker.config, worker.eos_token_ids) == () and worker.role_spec.head == "lm"
    default = ActorRolloutWorker(actor, [0, 5], 0)
    assert stop_token_ids(default.config, default.eos_token_ids) == (0, 5)
