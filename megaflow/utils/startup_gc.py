"""Python's garbage collector during a process's start-up: paused, then one collection and a freeze.

A megaflow process's start-up (importing torch, megatron-core, transformers and vLLM, building
models, engines and optimizers) creates most of the objects it will ever hold: about 700,000
tracked objects in a worker. CPython runs a full collection each time the heap has grown by a
quarter, and every full collection rescans all of them (0.8-0.9 s per collection at that size on a
2-core CPU; 7 full collections during a worker's imports and 6 more while vLLM builds its engine
were measured, 4-6 s of the start-up in all). Those objects are never garbage: modules, classes,
functions, parameters.

:func:`pause` turns automatic collection off at the start of the process's start-up;
:func:`resume` ends it with one full collection (what start-up left as cyclic garbage is freed),
then moves every surviving object into the permanent generation (:func:`gc.freeze`, as vLLM's
engine does with its own heap after start-up) and turns automatic collection back on, so later
collections scan only what the steps create. Reference counting frees non-cyclic objects
throughout; only cycles created while paused wait for :func:`resume`.
"""
from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Turn automatic garbage collection off until :func:`resume` (a no-op when it is already off,
    whoever turned it off: that owner keeps control)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def paused() -> bool:
    """Whether :func:`pause` turned collection off and :func:`resume` has not run yet."""
    return _paused


def resume(*, freeze: bool = True) -> None:
    """End a :func:`pause`: one full collection, with ``freeze`` :func:`gc.freeze` of what
    survives (a worker process; the controller, which may be a test process, does not freeze),
    automatic collection back on. A no-op when :func:`pause` did not turn collection off."""
    global _paused
    if not _paused:
        return
    _paused = False
    if freeze:
        collect_and_freeze()
    else:
        gc.collect()
    gc.enable()


def collect_and_freeze() -> None:
    """One full collection, then every surviving object into the permanent generation
    (:func:`gc.freeze`): later full collections skip them.

    Also called before a vLLM engine is built (:class:`megaflow.rollout.vllm_rollout.VLLMRollout`):
    vLLM's engine start runs full collections explicitly (two in its model loader, three in its
    ``freeze_gc_heap``, explicit calls that run even while collection is paused); frozen first, a
    trainer process's heap of torch, megatron-core, transformers and vLLM is scanned once instead.
    """
    gc.collect()
    gc.freeze()
