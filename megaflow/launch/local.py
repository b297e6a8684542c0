"""A single-machine Ray that listens on the loopback interface only.

Ray 2.60 on Linux binds its servers (GCS, raylet, object manager, every worker's gRPC
server, the runtime-env and dashboard agents) to the node's IP address, or to all
interfaces, and ``ray.init(_node_ip_address="127.0.0.1")`` alone does not change that:
Ray "resolves" a loopback address to the machine's routable one. The one switch it
offers is the single-machine mode it uses on macOS and Windows,
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``):
the node address is then 127.0.0.1 and every server binds to it. Ray reads the variable
when it is imported, in the controller and in each process it starts, so
:func:`loopback_ray_options` sets it in the environment (inherited by Ray's processes)
and in the already imported module of this process.

The result is checked by ``tests/trainer/test_ray_localhost.py`` with the socket table
of a running Ray session.
"""
from __future__ import annotations

import os
from typing import Any

LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_ray_options() -> dict[str, Any]:
    """Prepare this process for a local ``ray.init(address="local", ...)`` bound to 127.0.0.1
    and return the extra ``ray.init`` keyword arguments (``_node_ip_address``).

    Only for a Ray started by this process: a node in this mode cannot join or host a
    multi-machine cluster.
    """
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    return {"_node_ip_address": LOOPBACK}


__all__ = ["LOOPBACK", "loopback_ray_options"]
