"""The Python sandbox against hostile code: each attempt ends as an error observation within
its limit, the host untouched, no process left behind."""
import os
import resource
import socket

import pytest

from megaflow.agent.sandbox import (
    PythonInterpreter, SandboxLimits, live_sandbox_processes, network_namespace_available, run_python,
)
from megaflow.agent.tool import ToolCall, run_tool_call

LIMITS = SandboxLimits(timeout_s=30, cpu_s=2, memory_bytes=256 << 20, file_bytes=64 << 10, num_processes=4)


@pytest.fixture(autouse=True)
def _nothing_left_running():
    yield
    assert live_sandbox_processes() == []


def test_runs_code_and_captures_output():
    result = run_python("import math\nprint(math.factorial(20))\nopen('f.txt', 'w').write('ok')\n"
                        "print(open('f.txt').read())", LIMITS)
    assert (result.error, result.output) == (None, "2432902008176640000\nok\n")


def test_limits_are_set_in_the_child():
    code = ("import resource as r\nprint([r.getrlimit(k)[0] for k in "
            "(r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_NPROC)])")
    result = run_python(code, LIMITS)
    assert result.output.strip() == str([LIMITS.cpu_s, LIMITS.memory_bytes, LIMITS.file_bytes, LIMITS.num_processes])


def test_network_connection_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')"
        result = run_python(code, LIMITS)
        with pytest.raises(socket.timeout):
            server.accept()  # the host's listener never saw the sandbox
    assert result.error == "exit_status" and "connected" not in result.output
    expected = "Network is unreachable" if network_namespace_available() else "socket.connect is not allowed"
    assert expected in result.output


def test_write_outside_the_working_directory(tmp_path):
    os.chmod(tmp_path, 0o777)  # writable for the sandbox's uid too: only the sandbox's own barrier stops it
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.chdir({str(tmp_path)!r})\n"
                 f"open('escaped.txt', 'w').write('x')", f"import os\nos.mkdir({str(tmp_path / 'd')!r})"):
        result = run_python(code, LIMITS)
        assert result.error == "exit_status" and "PermissionError" in result.output
    assert list(tmp_path.iterdir()) == []


def test_fork_bomb():
    result = run_python("import os\nwhile True:\n    os.fork()", LIMITS)
    assert result.error == "exit_status" and "os.fork is not allowed" in result.output
    for code in ("import os\nos.system('sleep 100')", "import os\nos.posix_spawn('/bin/sleep', ['sleep', '100'], {})"):
        result = run_python(code, LIMITS)
        assert result.error == "exit_status" and "is not allowed" in result.output


def test_memory_bomb():
    result = run_python("x = bytearray(10 ** 10)", LIMITS)
    assert result.error == "memory"
    result = run_python("x = []\nwhile True:\n    x.append(' ' * 10 ** 6)", LIMITS)
    assert result.error == "memory"


def test_endless_loop_hits_the_cpu_limit():
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=120, cpu_s=1))
    assert result.error == "cpu_time" and result.seconds < 120


def test_sleeping_loop_hits_the_timeout():
    result = run_python("import time\nwhile True:\n    time.sleep(1)", SandboxLimits(timeout_s=2))
    assert result.error == "timeout" and result.seconds < 10


def test_huge_output_is_cut_by_the_file_size_limit():
    result = run_python("while True:\n    print('x' * 1000)", LIMITS)
    assert result.error == "output_limit" and len(result.output) <= LIMITS.max_output_chars


def test_the_tool_turns_failures_into_error_observations():
    tools = {"python": PythonInterpreter(timeout_s=2, cpu_s=1)}
    ok = run_tool_call(ToolCall("python", {"code": "print(6 * 7)"}), tools)
    assert (ok.text, ok.error) == ("42\n", None)
    loop = run_tool_call(ToolCall("python", {"code": "while True: pass"}), tools)
    assert loop.error in ("cpu_time", "timeout") and loop.text.startswith("Error:")
    crash = run_tool_call(ToolCall("python", {"code": "1/0"}), tools)
    assert crash.error == "exit_status" and "ZeroDivisionError" in crash.text


def test_host_limits_untouched():
    before = resource.getrlimit(resource.RLIMIT_AS)
    run_python("print(1)", LIMITS)
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_bad_limits_refused():
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s"):
        SandboxLimits(cpu_s=0)
