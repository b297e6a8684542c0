"""Which CUDA device a rank uses: the one its launcher made visible, whatever its place on the node.

Under Ray every rank asks for ``num_gpus=1``
(:mod:`megaflow.single_controller.resource_pool`), so Ray sets ``CUDA_VISIBLE_DEVICES`` to
that one GPU and the process sees it as device 0, while the rank's index on its node may be
0..7. Megatron (``torch.cuda.set_device``), vLLM's external launcher (it reads
``$LOCAL_RANK`` and asserts ``local_rank < torch.cuda.device_count()``) and vLLM's process
groups (``cuda:{local_rank}``) all take ``$LOCAL_RANK`` as a device index, so it must be the
device index: 0 when one GPU is visible. The rank's index on the node is kept in
``$MEGAFLOW_NODE_LOCAL_RANK``. With several visible GPUs (``torchrun``, one process per
GPU, every GPU visible) the node index is the device index, as before. Without CUDA
``$LOCAL_RANK`` stays the node index (nothing to index).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

#: Environment variable holding the rank's index among its group's ranks on its node.
NODE_LOCAL_RANK_ENV = "MEGAFLOW_NODE_LOCAL_RANK"


def device_local_rank(node_local_rank: int, visible_devices: int) -> int:
    """The ``$LOCAL_RANK`` (CUDA device index) of a rank.

    Args:
        node_local_rank: the rank's index among its group's ranks on the node.
        visible_devices: ``torch.cuda.device_count()`` in the rank's process (0 without CUDA).

    Returns:
        0 with one visible device (Ray's one GPU per rank); ``node_local_rank`` otherwise.

    Raises:
        RuntimeError: several visible devices and ``node_local_rank`` not one of them.
    """
    if visible_devices == 1:
        return 0
    if visible_devices > 1 and not 0 <= node_local_rank < visible_devices:
        raise RuntimeError(f"rank with node-local index {node_local_rank} sees {visible_devices} CUDA devices "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): no device "
                           f"{node_local_rank}; give each rank one GPU or make every GPU of the node visible")
    return node_local_rank


def _visible_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device_env(node_local_rank: int) -> dict[str, str]:
    """``LOCAL_RANK`` (the device index, :func:`device_local_rank`) and
    ``MEGAFLOW_NODE_LOCAL_RANK`` (the node index) for a rank's process environment."""
    return {"LOCAL_RANK": str(device_local_rank(node_local_rank, _visible_devices())),
            NODE_LOCAL_RANK_ENV: str(node_local_rank)}


def pin_local_rank() -> int:
    """Make ``$LOCAL_RANK`` this process's CUDA device index and return it.

    The node index is read from ``$MEGAFLOW_NODE_LOCAL_RANK``, else from ``$LOCAL_RANK``,
    else ``rank % visible devices`` (0 without a process group) and kept in
    ``$MEGAFLOW_NODE_LOCAL_RANK``. Idempotent.

    Raises:
        RuntimeError: see :func:`device_local_rank`.
    """
    visible = _visible_devices()
    node = os.environ.get(NODE_LOCAL_RANK_ENV, os.environ.get("LOCAL_RANK"))
    if node is None:
        node = str(dist.get_rank() % visible) if visible and dist.is_initialized() else "0"
    index = device_local_rank(int(node), visible)
    os.environ.update({"LOCAL_RANK": str(index), NODE_LOCAL_RANK_ENV: node})
    return index


__all__ = ["NODE_LOCAL_RANK_ENV", "device_local_rank", "pin_local_rank", "rank_device_env"]
