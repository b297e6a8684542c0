"""``python -m megaflow.launch.wait``: wait until a Ray cluster can host a recipe's pools.

Used by the Slurm script before it starts the controller, and by hand on a manual
multi-node cluster::

    python -m megaflow.launch.wait --recipe llama70b_ppo --address 10.0.0.1:6379 --timeout 600

It loads the recipe with the same ``key.sub=value`` overrides the trainer gets, computes
the requirement (:func:`megaflow.launch.resources.launch_requirements`), connects to the
cluster and polls it (:func:`megaflow.launch.cluster.wait_for_cluster`). Exit status 0
when ready; 2 when the cluster is still short after the timeout (the message says what is
needed and what joined) or the recipe is invalid; 3 when the cluster cannot be reached.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megaflow.launch.cluster import ClusterNotReadyError, wait_for_cluster


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megaflow.launch.wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    parser.add_argument("--address", default=None,
                        help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, then the recipe's ray.address)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds to wait (default: the recipe's ray.resource_wait_timeout_s)")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    parser.add_argument("--hint", default=None, help="appended to the failure message (e.g. where logs are)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, as given to the trainer")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megaflow.config import ConfigError
    from megaflow.launch.resources import launch_requirements
    from megaflow.topology import load_run

    try:
        cfg = load_run(args.recipe, args.overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    address = args.address or os.environ.get("RAY_ADDRESS") or cfg.ray.address
    if not address:
        print("error: no Ray cluster address: pass --address HOST:PORT or set RAY_ADDRESS", file=sys.stderr)
        return 2
    timeout = args.timeout if args.timeout is not None else cfg.ray.resource_wait_timeout_s
    required = launch_requirements(cfg)

    import ray

    from megaflow.launch.auth import enable_token_auth

    try:
        enable_token_auth()  # an explicit address does not switch Ray's token mode on by itself
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        ray.init(address=address, namespace=cfg.ray.namespace, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError) as err:
        print(f"error: cannot connect to the Ray cluster at {address}: {err}", file=sys.stderr)
        return 3
    try:
        wait_for_cluster(required, timeout, poll_s=args.poll, address=address, hint=args.hint,
                         progress=lambda line: print(line, flush=True))
    except ClusterNotReadyError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
