"""Dispatch/collect rules without Ray: fake meshes, a counting ``put`` and simulated ranks."""
from __future__ import annotations

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from megaflow.protocol import DataProto
from megaflow.single_controller import (ChunkOutput, Dispatch, DispatchPlan, DPInfo, Execute, MeshInfo, MethodSpec,
                                        collect, make_plan, nd_compute, register, registered_methods)
from megaflow.single_controller.collect import collect_proto
from megaflow.single_controller.dispatch import plan_one_to_all, plan_proto

ND = MethodSpec(nd_compute("actor"), Execute.ALL, True)
DP = MethodSpec(Dispatch.DP_COMPUTE_PROTO, Execute.ALL, True)


def megatron_mesh(tp: int, dp: int, pp: int) -> MeshInfo:
    """(dp_rank, is_collect) per rank from megatron-core's own rank generator (default order)."""
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    coord: dict[int, dict[str, int]] = {}
    for name in ("tp", "dp", "pp"):
        for group in gen.get_ranks(name):
            for index, rank in enumerate(group):
                coord.setdefault(rank, {})[name] = index
    infos = [DPInfo(coord[r]["dp"], coord[r]["tp"] == 0 and coord[r]["pp"] == pp - 1) for r in range(tp * dp * pp)]
    return MeshInfo.from_dp_infos("actor", infos)


def make_batch(num_rows: int) -> DataProto:
    return DataProto.from_dict(
        {"row": torch.arange(num_rows), "input_ids": torch.arange(num_rows * 3).view(num_rows, 3),
         "response_mask": torch.ones(num_rows, 2, dtype=torch.long)},
        non_tensors={"uid": [f"u{i}" for i in range(num_rows)]})


class CountingPut:
    def __init__(self) -> None:
        self.objects: list = []

    def __call__(self, obj):
        self.objects.append(obj)
        return obj


def execute(plan: DispatchPlan, fn) -> list:
    """What the worker group does between dispatch and collect, on simulated ranks."""
    outputs = {}
    for rank, args, kwargs, keep in zip(plan.ranks, plan.args, plan.kwargs, plan.keep_output):
        out = fn(rank, *args, **kwargs)
        outputs[rank] = out if keep else None
    return [outputs[r] for r in plan.collect_ranks]


def tag_rows(rank: int, data: DataProto) -> DataProto:
    """Worker stand-in: one output row per input row, tagged with the executing rank."""
    return DataProto.from_dict({"row": data.batch["row"], "from_rank": torch.full((len(data),), rank),
                                "double": data.batch["input_ids"] * 2})


def test_megatron_rank_order_of_the_fake_mesh():
    # tp fastest, then dp, then pp: rank = tp_rank + 2 * dp_rank + 4 * pp_rank.
    mesh = megatron_mesh(tp=2, dp=2, pp=2)
    assert mesh.dp_rank_mapping == (0, 0, 1, 1, 0, 0, 1, 1)
    assert mesh.collect_mask == (False, False, False, False, True, False, True, False)
    assert mesh.dp_size == 2 and mesh.collect_ranks == (4, 6)


def test_nd_chunks_reach_exactly_the_ranks_of_their_dp_rank():
    mesh, put, data = megatron_mesh(2, 2, 2), CountingPut(), make_batch(8)
    plan = make_plan(ND, 8, (data,), {}, mesh=mesh, put=put)
    assert len(put.objects) == 2  # one object-store put per dp rank, not per rank
    expected_rows = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    for rank in range(8):
        chunk = plan.args[rank][0]
        dp_rank = (rank // 2) % 2
        assert chunk is put.objects[dp_rank]  # the same reference for all TP/PP peers
        assert chunk.batch["row"].tolist() == expected_rows[dp_rank]
        assert list(chunk.non_tensor_batch["uid"]) == [f"u{i}" for i in expected_rows[dp_rank]]
    assert plan.keep_output == mesh.collect_mask
    out = collect(plan, execute(plan, tag_rows))
    assert out.batch["row"].tolist() == list(range(8))
    assert out.batch["from_rank"].tolist() == [4] * 4 + [6] * 4  # only the collect ranks' outputs
    torch.testing.assert_close(out.batch["double"], data.batch["input_ids"] * 2)


def test_nd_keyword_and_positional_arguments_are_split_alike():
    mesh, data = megatron_mesh(2, 2, 2), make_batch(4)
    plan = make_plan(ND, 8, (data,), {"other": data.select(["row"])}, mesh=mesh)
    for rank in range(8):
        assert plan.args[rank][0].batch["row"].tolist() == plan.kwargs[rank]["other"].batch["row"].tolist()


@pytest.mark.parametrize("spec,mesh", [(DP, None), (ND, MeshInfo("actor", (0, 1, 2, 3), (True,) * 4)),
                                       (ND, MeshInfo("actor", (0, 0, 1, 1, 2, 2, 3, 3), (True, False) * 4))])
def test_batch_of_6_with_dp_4_is_padded_and_unpadded(spec, mesh):
    layout = mesh or MeshInfo.data_parallel(4)
    data = make_batch(6)
    plan = make_plan(spec, layout.world_size, (data,), {}, mesh=mesh)
    assert plan.pad_size == 2 and plan.num_rows == 8
    by_dp = [plan.args[r][0].batch["row"].tolist() for r in plan.collect_ranks]
    assert by_dp == [[0, 1], [2, 3], [4, 5], [0, 1]]  # padded rows copy real rows...
    for rank in plan.ranks:  # every peer of a dp rank holds that dp rank's chunk
        assert plan.args[rank][0] is plan.args[plan.collect_ranks[layout.dp_rank_mapping[rank]]][0]
    last = plan.args[plan.collect_ranks[3]][0]
    assert last.batch["response_mask"].sum() == 0  # ...and carry no loss weight
    out = collect(plan, execute(plan, tag_rows))
    assert len(out) == 6
    for i in range(6):  # slow per-row reference
        assert out.batch["row"][i] == i
        assert torch.equal(out.batch["double"][i], data.batch["input_ids"][i] * 2)


def test_collect_ranks_in_decreasing_dp_order_still_return_input_order():
    # dp rank 2 lives on ranks 0-1, dp rank 0 on ranks 4-5; collect ranks 0, 3 and 4 are not
    # ordered like their dp ranks (2, 1, 0).
    mesh = MeshInfo("gen", (2, 2, 1, 1, 0, 0), (True, False, False, True, True, False))
    assert mesh.collect_ranks == (4, 3, 0)
    plan = make_plan(MethodSpec(nd_compute("gen"), Execute.ALL, True), 6, (make_batch(7),), {}, mesh=mesh)
    assert plan.args[0][0].batch["row"].tolist() == [6, 0, 1]  # dp 2 = the last chunk, padded with rows 0, 1
    out = collect(plan, execute(plan, tag_rows))
    assert out.batch["row"].tolist() == list(range(7))
    assert out.batch["from_rank"].tolist() == [4, 4, 4, 3, 3, 3, 0]


def test_non_dataproto_outputs_come_back_per_dp_rank():
    mesh = megatron_mesh(2, 2, 1)
    plan = make_plan(ND, 4, (make_batch(4),), {}, mesh=mesh)
    out = collect(plan, execute(plan, lambda rank, data: {"rank": rank, "num_rows": len(data)}))
    assert out == [{"rank": 0, "num_rows": 2}, {"rank": 2, "num_rows": 2}]


@pytest.mark.parametrize("mapping,mask,match", [
    ((0, 0, 1, 1), (True, True, True, False), "exactly"),
    ((0, 0, 1, 1), (True, False, False, False), "exactly"),
    ((0, 0, 2, 2), (True, False, True, False), "have no rank"),
    ((0, 1), (True,), "equal length"),
    ((-1, 0), (True, True), "negative"),
])
def test_inconsistent_mesh_layouts_are_rejected(mapping, mask, match):
    with pytest.raises(ValueError, match=match):
        MeshInfo("actor", mapping, mask)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (({"input_ids": torch.zeros(2, 2)},), {}, TypeError, "argument 0 must be a DataProto.*got dict"),
    ((), {"data": [1, 2]}, TypeError, "argument 'data' must be a DataProto"),
    ((), {}, TypeError, "at least one DataProto"),
    ((make_batch(4), make_batch(3)), {}, ValueError, "different row counts"),
])
def test_bad_proto_arguments_fail_before_anything_is_put(args, kwargs, error, match):
    put = CountingPut()
    with pytest.raises(error, match=match):
        make_plan(DP, 2, args, kwargs, put=put, method="actor.compute_log_prob")
    assert put.objects == []


def test_one_to_all_puts_a_batch_once_and_shares_it():
    put, data = CountingPut(), make_batch(3)
    plan = plan_one_to_all(4, (data, 7), {"flag": True}, put=put)
    assert len(put.objects) == 1 and all(a[0] is data and a[1] == 7 for a in plan.args)
    assert collect(plan, ["r0", "r1", "r2", "r3"]) == ["r0", "r1", "r2", "r3"]
    zero = make_plan(MethodSpec(Dispatch.RANK_ZERO, Execute.RANK_ZERO, True), 4, (1,), {})
    assert zero.ranks == (0,) and collect(zero, ["only"]) == "only"


def test_collect_of_worker_cut_chunks_uses_their_padding_reports():
    # Future input: each worker padded and cut its own chunk (7 rows into 4 chunks of 2).
    pieces = [make_batch(8)[i * 2:(i + 1) * 2] for i in range(4)]
    outputs = [ChunkOutput(p, 2, pad) for p, pad in zip(pieces, (0, 0, 0, 1))]
    out = collect_proto(outputs, pad_size=None, num_rows=None)
    assert out.batch["row"].tolist() == list(range(7))
    with pytest.raises(ValueError, match="one row per input row"):
        collect_proto([ChunkOutput(make_batch(3), 2, 0), ChunkOutput(make_batch(2), 2, 1)], None, None)


def test_collect_of_rows_with_metrics_concatenates_rows_and_keeps_each_ranks_metrics():
    from megaflow.single_controller import GroupProtoResult, ProtoResult

    # 5 rows on 2 dp ranks: padded to 6, each rank returns its 3 rows and its own metrics
    plan = make_plan(DP, 2, (make_batch(5),), {})
    outputs = [ProtoResult(a[0], {"rank": float(r)}) for r, a in enumerate(plan.args)]
    out = collect(plan, outputs)
    assert isinstance(out, GroupProtoResult)
    assert out.batch.batch["row"].tolist() == [0, 1, 2, 3, 4]
    assert out.metrics == [{"rank": 0.0}, {"rank": 1.0}]
    with pytest.raises(ValueError, match="one row per input row"):
        collect(plan, [ProtoResult(make_batch(3), {}), ProtoResult(make_batch(2), {})])


def test_plan_proto_with_a_mixed_future_and_batch_is_refused():
    from megaflow.single_controller import DataProtoFuture

    future = DataProtoFuture([], [], [0, 1], 0, 4, "actor.compute_log_prob")
    with pytest.raises(TypeError, match="mixing DataProto and DataProtoFuture"):
        plan_proto(MeshInfo.data_parallel(2), (make_batch(4), future), {})
    plan = plan_proto(MeshInfo.data_parallel(2), (future,), {})
    assert plan.pad_size is None and [a[0].index for a in plan.args] == [0, 1]
    assert all(a[0].source is future and a[0].num_chunks == 2 for a in plan.args)


def test_register_validates_modes_and_marks_methods():
    with pytest.raises(TypeError, match="dispatch_mode must be"):
        register("one_to_all")
    with pytest.raises(ValueError, match="only combines"):
        register(Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO)
    with pytest.raises(ValueError, match="must be Execute.RANK_ZERO"):
        register(Dispatch.RANK_ZERO, execute_mode=Execute.ALL)
    with pytest.raises(TypeError, match="parentheses"):
        register(lambda self: None)
    with pytest.raises(ValueError, match="non-empty mesh name"):
        nd_compute("")

    class Base:
        @register(nd_compute("actor"), blocking=False)
        def compute(self, data):
            return data

    class Child(Base):
        @register(Dispatch.RANK_ZERO)
        def save(self):
            return 1

        def helper(self):
            return 2

    methods = registered_methods(Child)
    assert set(methods) == {"compute", "save"}
    assert methods["compute"] == MethodSpec(nd_compute("actor"), Execute.ALL, False)
    assert methods["save"].execute_mode is Execute.RANK_ZERO
    assert Child().save() == 1  # the method itself is unchanged
