"""megaflow.utils.startup_gc: collection paused during start-up, then one collection and a freeze."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from megaflow.utils import startup_gc


def test_pause_and_resume_without_freeze_in_this_process():
    assert gc.isenabled() and not startup_gc.paused()
    frozen_before = gc.get_freeze_count()
    startup_gc.pause()
    try:
        assert not gc.isenabled() and startup_gc.paused()
        startup_gc.pause()  # a second pause changes nothing
        assert startup_gc.paused()
    finally:
        startup_gc.resume(freeze=False)
    assert gc.isenabled() and not startup_gc.paused()
    assert gc.get_freeze_count() == frozen_before
    startup_gc.resume()  # not paused: a no-op (no freeze either)
    assert gc.get_freeze_count() == frozen_before


def test_pause_leaves_a_collector_that_someone_else_turned_off_to_them():
    gc.disable()
    try:
        startup_gc.pause()
        assert not startup_gc.paused()
        startup_gc.resume()
        assert not gc.isenabled()  # still theirs to turn back on
    finally:
        gc.enable()


def test_resume_frees_cycles_made_while_paused_and_freezes_the_rest():
    """In a fresh interpreter (a freeze is for good): a reference cycle made while paused is not
    collected until resume, which collects it, freezes what survives and turns collection on."""
    code = textwrap.dedent("""
        import gc, weakref
        from megaflow.utils import startup_gc
        class Node:
            pass
        startup_gc.pause()
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        for _ in range(3):
            [Node() for _ in range(5000)]  # allocations that would trigger automatic collections
        assert alive() is not None, "collected while paused"
        keep = [Node() for _ in range(1000)]
        startup_gc.resume()
        assert alive() is None, "the cycle survived resume"
        assert gc.isenabled() and gc.get_freeze_count() >= 1000
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
