"""The agent loop of one generation replica: multi-turn trajectories with tools, token ids end to end.

Trajectories decode together through the engine's request/step loop (continuous batching):
every turn is one engine request; when a turn ends with tool calls, the calls run in a
worker thread while the engine keeps stepping the other trajectories, and the next turn's
request is added once the observations are back. A trajectory's turns run on the same
engine, so each turn's prompt (the previous prompt + sampled ids + observation ids) hits
the prefix cache.

TP: every rank of the replica drives its own engine in lockstep with the same requests.
Only the replica's rank 0 (the tool rank) renders prompts, parses calls and runs tools;
after every engine step it broadcasts the requests to add (token ids, token budget, seed)
to the other ranks, so every rank feeds the engine the same observation tokens, and at the
end it broadcasts the finished trajectories (:func:`tp_broadcaster`).

Limits (:class:`AgentLimits`): assistant turns, response tokens summed over turns
(sampled + observation tokens, the batch's response span) and tool seconds per
trajectory. Why a trajectory ended is kept in :attr:`Trajectory.stop_reason`:
``"answer"`` (a turn without tool calls), ``"max_turns"``, ``"length"`` (the token budget or
the engine's ``max_model_len``), ``"tool_time"``, ``"env_done"``.
"""
from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megaflow.agent.environment import DEFAULT_ENVIRONMENT, Environment, EnvStep
from megaflow.agent.parser import parse_tool_calls
from megaflow.agent.registry import make_environment
from megaflow.agent.template import ChatRenderer

STOP_REASONS = ("answer", "max_turns", "length", "tool_time", "env_done")


class AgentLoopError(RuntimeError):
    """The tool rank of a replica failed; raised on every rank of the replica."""


@dataclass(frozen=True)
class AgentLimits:
    """Per-trajectory limits: assistant turns, response tokens over all turns, tool wall-clock seconds."""

    max_turns: int = 4
    response_length: int = 512
    tool_time_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "response_length", "tool_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AgentLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class ToolCallRecord:
    """One tool call of a trajectory: the tool ("" if the call was malformed), error kind or None, seconds."""

    tool: str
    error: str | None
    seconds: float


@dataclass
class Trajectory:
    """One multi-turn trajectory: one row of the rollout batch.

    ``response_ids`` covers all turns: sampled ids (``response_mask`` 1, ``log_probs`` the
    engine's) and observation ids (mask 0, log-prob 0). ``messages`` is the conversation as
    text (assistant turns decoded for reading and the template check only).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCallRecord] = field(default_factory=list)
    num_turns: int = 0
    num_observation_tokens: int = 0
    stop_reason: str = ""
    env_reward: float | None = None
    template_ok: bool = True

    @property
    def num_tool_calls(self) -> int:
        return len(self.calls)

    @property
    def num_tool_errors(self) -> int:
        return sum(c.error is not None for c in self.calls)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def tool_seconds(self) -> float:
        return sum(c.seconds for c in self.calls)


@dataclass(frozen=True)
class TurnRequest:
    """One engine request: trajectory ``index``'s next turn, its full prompt ids, token budget, seed."""

    index: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int


class TurnEngine(Protocol):
    """What the loop needs of an engine: add a turn request, step, return the finished turns."""

    def add(self, key: str, request: TurnRequest) -> None: ...

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        """One engine step; ``(key, sampled ids, their log-probs)`` of each turn that finished."""

    def abort_all(self) -> None:
        """Drop every unfinished request (after a failed run)."""


Broadcast = Callable[[Any], Any]


def tp_broadcaster(group: Any, src: int) -> Broadcast:
    """A broadcast of a picklable object from global rank ``src`` over ``group`` (the replica's TP group)."""
    import torch.distributed as dist

    def broadcast(obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    return broadcast


def _no_broadcast(obj: Any) -> Any:
    return obj


class AgentLoop:
    """Runs a batch of rows as multi-turn trajectories on one replica (module docstring).

    Args:
        engine: this rank's :class:`TurnEngine`.
        renderer: the chat template (used on the tool rank only; may be None elsewhere).
        decode: token ids -> text, for parsing calls (tool rank only).
        limits: :class:`AgentLimits`.
        eos_token_ids: ids that end an assistant turn (the engine's stop ids).
        max_model_len: the engine's longest prompt + response.
        is_tool_rank: True on the replica's rank 0.
        broadcast: from the tool rank to the replica's ranks (:func:`tp_broadcaster`);
            identity for a 1-rank replica.
        max_tool_threads: trajectories whose tools run at the same time.
    """

    def __init__(self, engine: TurnEngine, renderer: ChatRenderer | None, decode: Callable[[Sequence[int]], str] | None,
                 limits: AgentLimits, *, eos_token_ids: Sequence[int], max_model_len: int,
                 is_tool_rank: bool = True, broadcast: Broadcast = _no_broadcast, max_tool_threads: int = 8) -> None:
        self.engine, self.renderer, self.decode, self.limits = engine, renderer, decode, limits
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len)
        self.is_tool_rank, self.broadcast = is_tool_rank, broadcast
        self.max_tool_threads = max_tool_threads

    def run(self, rows: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> list[Trajectory]:
        """Roll out one trajectory per row (``seeds[i]`` seeds row ``i``'s turns); same result on every rank.

        Raises:
            AgentLoopError: on every rank of the replica, when the tool rank failed (a row
                its environment refuses, a chat template error); the other ranks would
                otherwise wait for its broadcast until the collective timeout.
        """
        run: _ToolRankRun | None = None

        def begin() -> list[TurnRequest]:
            nonlocal run
            run = _ToolRankRun(self, rows, seeds)
            return run.start()

        try:
            active = self._add(self._shared(begin if self.is_tool_rank else None))
            while True:
                finished = self.engine.step() if active else []
                active -= len(finished)
                advance = functools.partial(run.advance, finished, engine_idle=active == 0) if run else None
                update = self._shared(advance)
                active += self._add(update["requests"])
                if update["done"]:
                    break
            return self._shared(run.finish if run else None)
        except AgentLoopError:
            self.engine.abort_all()  # the next run starts from an empty engine
            if run is not None:
                run.pool.shutdown(wait=False, cancel_futures=True)
            raise

    def _shared(self, produce: Callable[[], Any] | None) -> Any:
        """``produce()`` on the tool rank, broadcast to the replica; a failure is raised on every rank."""
        try:
            payload = ("ok", produce()) if produce is not None else None
        except Exception as e:  # noqa: BLE001 - any failure is sent to the other ranks, then raised here too
            payload = ("error", f"{type(e).__name__}: {e}")
        status, value = self.broadcast(payload)
        if status == "error":
            raise AgentLoopError(f"agent loop failed on the replica's tool rank: {value}")
        return value

    def _add(self, requests: list[TurnRequest]) -> int:
        for request in requests:
            self.engine.add(f"{request.index}:{len(request.prompt_ids)}", request)
        return len(requests)


class _ToolRankRun:
    """The tool rank's state of one :meth:`AgentLoop.run`."""

    def __init__(self, loop: AgentLoop, rows: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> None:
        if len(rows) != len(seeds):
            raise ValueError(f"got {len(seeds)} seeds for {len(rows)} rows")
        if loop.renderer is None or loop.decode is None:
            raise ValueError("the tool rank's AgentLoop needs a renderer and a decode function")
        self.loop, self.limits, self.seeds = loop, loop.limits, [int(s) for s in seeds]
        self.renderer, self.decode = loop.renderer, loop.decode
        self.envs: list[Environment] = [make_environment(r.get("agent_name") or DEFAULT_ENVIRONMENT) for r in rows]
        self.trajectories: list[Trajectory] = []
        for env, row in zip(self.envs, rows, strict=True):
            start = env.reset(row)
            tools = [t.spec() for t in start.tools.values()]
            self.trajectories.append(Trajectory(self.renderer.prompt_ids(start.messages, tools),
                                                messages=list(start.messages), tools=tools))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=loop.max_tool_threads,
                                                          thread_name_prefix="megaflow-agent")
        self.pending: dict[concurrent.futures.Future, int] = {}

    def start(self) -> list[TurnRequest]:
        requests = [self._next_turn(i) for i in range(len(self.trajectories))]
        return [r for r in requests if r is not None]

    def advance(self, finished: list[tuple[str, list[int], list[float]]], engine_idle: bool) -> dict[str, Any]:
        for key, ids, log_probs in finished:
            self._sampled(int(key.split(":")[0]), ids, log_probs)
        if engine_idle and self.pending:  # nothing to decode: wait for a tool rather than spin
            concurrent.futures.wait(self.pending, return_when=concurrent.futures.FIRST_COMPLETED)
        requests = []
        for future in [f for f in self.pending if f.done()]:
            index = self.pending.pop(future)
            request = self._observed(index, future.result())
            if request is not None:
                requests.append(request)
        return {"requests": requests, "done": engine_idle and not requests and not self.pending}

    def finish(self) -> list[Trajectory]:
        self.pool.shutdown(wait=True)
        for t in self.trajectories:
            t.template_ok = self.renderer.matches_template(t.messages, t.tools, t.prompt_ids + t.response_ids)
        return self.trajectories

    # ---------------------------------------------------------------- one trajectory
    def _sampled(self, index: int, ids: list[int], log_probs: list[float]) -> None:
        t = self.trajectories[index]
        t.num_turns += 1
        t.response_ids += ids
        t.response_mask += [1] * len(ids)
        t.log_probs += log_probs
        ended = bool(ids) and ids[-1] in self.loop.eos_token_ids
        text = self.decode(ids[:-1] if ended else ids)
        t.messages.append({"role": "assistant", "content": text})
        calls = parse_tool_calls(text) if ended else []
        if not ended:
            t.stop_reason = "length"
        elif not calls:
            t.stop_reason = "answer"
        elif t.num_turns >= self.limits.max_turns:
            t.stop_reason = "max_turns"
        else:
            self.pending[self.pool.submit(self.envs[index].step, calls)] = index

    def _observed(self, index: int, step: EnvStep) -> TurnRequest | None:
        t = self.trajectories[index]
        t.calls += [ToolCallRecord(o.tool, o.error, o.seconds) for o in step.observations]
        if step.reward is not None:
            t.env_reward = step.reward
        if step.done:
            t.stop_reason = "env_done"
            return None
        if t.tool_seconds > self.limits.tool_time_s:
            t.stop_reason = "tool_time"
            return None
        observation = self.renderer.observation_ids([(o.tool, o.text) for o in step.observations])
        if len(t.response_ids) + len(observation) >= self.limits.response_length:
            t.stop_reason = "length"
            return None
        t.messages += [{"role": "tool", "name": o.tool, "content": o.text} for o in step.observations]
        t.response_ids += observation
        t.response_mask += [0] * len(observation)
        t.log_probs += [0.0] * len(observation)
        t.num_observation_tokens += len(observation)
        return self._next_turn(index)

    def _next_turn(self, index: int) -> TurnRequest | None:
        t = self.trajectories[index]
        ids = t.prompt_ids + t.response_ids
        budget = min(self.limits.response_length - len(t.response_ids), self.loop.max_model_len - len(ids))
        if budget <= 0:
            t.stop_reason = "length"
            return None
        from megaflow.rollout.sampling import request_seeds

        return TurnRequest(index, ids, budget, request_seeds(self.seeds[index], 1, stream=t.num_turns)[0])


__all__ = ["AgentLimits", "AgentLoop", "AgentLoopError", "STOP_REASONS", "ToolCallRecord", "Trajectory", "TurnEngine",
           "TurnRequest", "tp_broadcaster"]
