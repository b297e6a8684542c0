"""Tools and environments chosen per row (verl's extra_info.tools_kwargs), the registry, and
every way a call can go wrong ending as an error observation."""
import time

import pytest

from megaflow.agent import (
    Environment, EnvReset, EnvStep, Tool, ToolCall, check_rows, make_environment, make_tool, parse_tool_calls,
    register_environment, register_tool, run_tool_call, unregister_environment, unregister_tool,
)


class Echo(Tool):
    name = "echo"
    description = "echo the text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}

    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    def call(self, args):
        if args["text"] == "boom":
            raise RuntimeError("exploded")
        if args["text"] == "slow":
            time.sleep(3)
        return self.prefix + args["text"]


@pytest.fixture
def echo():
    register_tool("echo")(Echo)
    yield
    unregister_tool("echo")


def _row(tools, **extra):
    return {"prompt": [{"role": "user", "content": "hi"}], "extra_info": {"tools_kwargs": tools}, **extra}


def test_tools_chosen_per_row_with_create_kwargs(echo):
    env = make_environment("tool_agent")
    start = env.reset(_row({"echo": {"create_kwargs": {"prefix": "> "}}, "calculator": {}}))
    assert start.messages == [{"role": "user", "content": "hi"}] and sorted(start.tools) == ["calculator", "echo"]
    text = ('<tool_call>{"name": "echo", "arguments": {"text": "a"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    step = env.step(parse_tool_calls(text))
    assert [o.text for o in step.observations] == ["> a", "6"] and not step.done and step.reward is None
    assert env.reset(_row({})).tools == {}  # a row without tools has none


def test_every_failure_is_an_observation(echo):
    tools = {"echo": Echo()}
    cases = {
        "unknown_tool": ToolCall("nope", {}),
        "bad_arguments": ToolCall("echo", {"text": 3}),
        "exception": ToolCall("echo", {"text": "boom"}),
    }
    for kind, call in cases.items():
        observation = run_tool_call(call, tools)
        assert observation.error == kind and observation.text.startswith("Error:")
    slow = Echo()
    slow.timeout_s = 0.2
    observation = run_tool_call(ToolCall("echo", {"text": "slow"}), {"echo": slow})
    assert observation.error == "timeout" and observation.seconds < 3
    step = make_environment("tool_agent").step(parse_tool_calls("<tool_call>{oops</tool_call>"))
    assert step.observations[0].error == "malformed"


def test_rows_refused_at_load_naming_the_row(echo):
    check_rows([_row({"echo": {}}), _row({"calculator": {}})])
    with pytest.raises(ValueError, match=r"train row 1: unknown tool 'search'"):
        check_rows([_row({"echo": {}}), _row({"search": {}})], source="train")
    with pytest.raises(ValueError, match=r"row 0: unknown environment 'chess'"):
        check_rows([_row({}, agent_name="chess")])
    with pytest.raises(ValueError, match=r"row 0: tool 'echo': bad create_kwargs"):
        check_rows([_row({"echo": {"create_kwargs": {"colour": "red"}}})])
    with pytest.raises(ValueError, match=r"row 0: extra_info.tools_kwargs must map"):
        check_rows([_row(["calculator"])])


def test_schema_the_parser_cannot_use_is_refused():
    class BadSchema(Echo):
        name = "bad"
        parameters = {"type": "array"}

    class NotASchema(Echo):
        name = "worse"
        parameters = {"type": "object", "properties": {"x": {"type": 5}}}

    register_tool("bad")(BadSchema)
    register_tool("worse")(NotASchema)
    try:
        with pytest.raises(ValueError, match="must be a JSON schema of type 'object'"):
            make_tool("bad")
        with pytest.raises(ValueError, match="not a valid JSON schema"):
            make_tool("worse")
    finally:
        unregister_tool("bad")
        unregister_tool("worse")


def test_custom_environment_registered_like_a_reward():
    @register_environment("countdown_game")
    class Game(Environment):
        def reset(self, row):
            self.turns = 0
            return EnvReset([{"role": "user", "content": row["prompt"]}])

        def step(self, calls):
            self.turns += 1
            return EnvStep([], done=self.turns == 2, reward=1.0 if self.turns == 2 else None)

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_environment("countdown_game")(Game)
        env = make_environment("countdown_game")
        assert env.reset({"prompt": "go"}).messages == [{"role": "user", "content": "go"}]
        assert env.step([]).done is False
        assert env.step([]) == EnvStep([], done=True, reward=1.0)
    finally:
        unregister_environment("countdown_game")
