"""Single controller: worker groups of Ray actors and the rules that dispatch calls to them.

The controller (the Ray driver) calls methods of :class:`RayWorkerGroup`; each call is
``collect(execute(dispatch(args)))`` as declared on the worker method with
:func:`register` (dispatch rules: :mod:`megaflow.single_controller.dispatch`).
"""
from megaflow.single_controller.collect import ChunkOutput, GroupProtoResult, ProtoResult
from megaflow.single_controller.decorator import (
                                                  Dispatch,
                                                  Execute,
                                                  MethodSpec,
                                                  NDCompute,
                                                  nd_compute,
                                                  register,
                                                  registered_methods,
)
from megaflow.single_controller.dispatch import DispatchPlan, DPInfo, MeshInfo, collect, make_plan
from megaflow.single_controller.errors import WorkerError
from megaflow.single_controller.futures import DataProtoFuture, FutureChunk
from megaflow.single_controller.resource_pool import ResourcePool
from megaflow.single_controller.worker import Worker, WorkerMetadata
from megaflow.single_controller.worker_group import (
                                                  ClassWithInitArgs,
                                                  ColocatedClassWithInitArgs,
                                                  RayWorkerGroup,
                                                  create_colocated_worker_cls,
)

__all__ = [
    "Dispatch", "Execute", "MethodSpec", "NDCompute", "nd_compute", "register", "registered_methods",
    "DPInfo", "MeshInfo", "DispatchPlan", "ChunkOutput", "ProtoResult", "GroupProtoResult", "make_plan", "collect",
    "WorkerError", "DataProtoFuture", "FutureChunk",
    "ResourcePool", "Worker", "WorkerMetadata",
    "RayWorkerGroup", "ClassWithInitArgs", "ColocatedClassWithInitArgs", "create_colocated_worker_cls",
]
