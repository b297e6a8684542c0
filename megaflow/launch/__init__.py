"""Launching megaflow on clusters: resource requirements, Ray cluster waits, Slurm scripts.

* :mod:`megaflow.launch.resources`: what a recipe's resource pools need from the cluster
  (:func:`launch_requirements`) and what a cluster lacks (:func:`unmet`);
* :mod:`megaflow.launch.cluster`: bounded waits for the Ray head and for the resources
  (:func:`wait_for_cluster`, raising :class:`ClusterNotReadyError`);
* :mod:`megaflow.launch.failures`: a dead worker process or node turned into a message
  naming node, role and rank;
* :mod:`megaflow.launch.node`: ``ray start`` on one node with megaflow's defaults;
* :mod:`megaflow.launch.auth`: Ray token authentication (required by default);
* :mod:`megaflow.launch.slurm` and :mod:`megaflow.launch.wait`: the sbatch generator and
  the wait command the generated script runs.
"""
from megaflow.launch.cluster import ClusterNotReadyError, wait_for_cluster, wait_for_port
from megaflow.launch.resources import LaunchRequirements, NodeResources, PoolRequirement, launch_requirements, unmet

__all__ = ["LaunchRequirements", "PoolRequirement", "NodeResources", "launch_requirements", "unmet",
           "ClusterNotReadyError", "wait_for_cluster", "wait_for_port"]
