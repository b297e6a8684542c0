"""Session-wide fixtures shared by all test areas."""
import os

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session (starting Ray costs ~8 s), started the way
    ``megaflow.trainer.main.init_ray`` starts a run's: the workers inherit the run's environment
    (one OpenMP thread, vLLM's log level, the warning filters) and run at nice 0, not Ray's 15,
    so that the suite's workers keep their share of the CPU next to another job on the machine."""
    import ray

    from megaflow.launch.node import node_env
    from megaflow.trainer.main import exported_env, worker_env

    if not ray.is_initialized():
        with exported_env({**worker_env(), **node_env()}):
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()
