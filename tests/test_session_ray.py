"""The suite's shared Ray (tests/conftest.py ``ray_session``) starts its workers as a run's local Ray does."""
from __future__ import annotations

import os


def test_session_ray_workers_run_at_the_suites_priority_with_the_run_environment(ray_session):
    from megaflow.trainer.main import worker_env

    @ray_session.remote(num_cpus=0)
    def probe() -> tuple[int, dict[str, str | None]]:
        return os.nice(0), {name: os.environ.get(name) for name in worker_env()}

    nice, env = ray_session.get(probe.remote())
    # Ray's default worker_niceness is 15: its workers would yield the CPU to any other job
    # on the machine. An explicitly exported RAY_worker_niceness is kept (node_env).
    assert nice == os.nice(0) + int(os.environ.get("RAY_worker_niceness", "0"))
    assert env == worker_env()
