"""A worker group that fails to start is torn down: its processes and its named placement
groups are gone, so a second build in the same Ray session can take the same names."""
import json
import time
import types

import pytest

TOKENIZER = types.SimpleNamespace(eos_token_id=2, pad_token_id=2)


def _live_megaflow_placement_groups(ray) -> list[str]:
    return sorted(pg["name"] for pg in ray.util.placement_group_table().values()
                  if pg["name"].startswith("megaflow_") and pg["state"] != "REMOVED")


def _free_cpus(ray, expected: float | None = None) -> float:
    """The cluster's unreserved CPUs (killed actors return theirs within moments: poll for ``expected``)."""
    deadline = time.monotonic() + 30
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if expected is None or free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_a_rank_that_fails_to_start_leaves_no_processes_or_placement_groups(ray_session, tmp_path):
    from megaflow.config import config_to_dict
    from megaflow.single_controller.errors import WorkerError
    from megaflow.topology import load_run, run_from_dict
    from megaflow.trainer.roles import build_worker_groups

    ray = ray_session
    groups_before, cpus_before = _live_megaflow_placement_groups(ray), _free_cpus(ray)
    tree = config_to_dict(load_run("tiny_arith_grpo", ["resources.procs_per_node=2", "resources.num_cpus_per_proc=1"]))
    hf_config = tree["model"]["hf_config"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config))  # a checkpoint without weights: init_model raises
    tree["model"]["hf_config"], tree["model"]["path"] = None, str(tmp_path)
    cfg = run_from_dict(tree)
    for _ in range(2):  # the second build reuses the pool's placement-group names
        with pytest.raises(WorkerError, match="init_model failed on role 'actor'"):
            build_worker_groups(cfg, TOKENIZER, total_steps=1)
        assert _live_megaflow_placement_groups(ray) == groups_before
        assert _free_cpus(ray, cpus_before) == cpus_before  # no worker process holds a CPU
