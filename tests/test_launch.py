"""run_distributed: spawned gloo worlds return per-rank results and surface rank errors."""
import pytest
import torch
import torch.distributed as dist

from megaflow.utils.launch import DistributedRunError, run_distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


@pytest.mark.slow
def test_all_reduce_sum_and_rank_error():
    assert run_distributed(_all_reduce, 2) == [3.0, 3.0]
    with pytest.raises(DistributedRunError, match="rank 1 raised:(.|\n)*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)


def _environment_and_modules(rank, world_size, preload):
    import os
    import sys

    missing = [m for m in preload if m not in sys.modules]
    return os.environ.get("MEGAFLOW_LAUNCH_PROBE"), os.getcwd(), sys.path[0], missing


@pytest.mark.slow
def test_ranks_see_the_callers_environment_at_the_call_and_fork_from_a_single_threaded_server(
        monkeypatch, tmp_path):
    """The ranks are forked by a server started at the first call: they still see the caller's
    os.environ, working directory and sys.path as they are at each later call, they start with
    the preloaded modules already imported, and the server runs one thread only (forking a
    multi-threaded process can leave a lock held in the child)."""
    import os
    import sys

    from megaflow.utils.launch import FORKSERVER_PRELOAD, forkserver_pid

    preload = list(FORKSERVER_PRELOAD)
    monkeypatch.setenv("MEGAFLOW_LAUNCH_PROBE", "first")
    first = run_distributed(_environment_and_modules, 2, preload)
    assert first == [("first", os.getcwd(), sys.path[0], [])] * 2
    server = forkserver_pid()
    assert server is not None
    threads = {t: open(f"/proc/{server}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{server}/task")}
    assert list(threads) == [str(server)], f"the forkserver runs threads: {threads}"
    monkeypatch.setenv("MEGAFLOW_LAUNCH_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "extra"))
    second = run_distributed(_environment_and_modules, 1, preload)
    assert second == [("second", str(tmp_path), str(tmp_path / "extra"), [])]
    assert forkserver_pid() == server  # one server for the whole session


def test_a_rank_gets_the_callers_environment_plus_what_the_preload_imports_set(monkeypatch):
    """In the forked rank, os.environ is the server's: its start environment (replaced by the
    caller's at the call) plus what its preload imports set (torch sets TORCHINDUCTOR_CACHE_DIR,
    say), which a spawned rank would have set importing them itself."""
    import os

    from megaflow.utils import launch

    server_start = {"A": "start", "B": "start", "E": "start"}
    monkeypatch.setattr(os, "environ", {"A": "start", "B": "set-by-import", "C": "new-by-import", "E": "start"})
    caller = {"A": "caller", "D": "caller"}
    assert launch._rank_environ(caller, server_start) == {"A": "caller", "B": "set-by-import",
                                                          "C": "new-by-import", "D": "caller"}
