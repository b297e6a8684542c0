"""Fixtures of the launch/Slurm tests."""
import os
import tempfile
from pathlib import Path

import pytest

import slurm_test_workers
from local_slurm import LocalSlurm, missing_binaries


@pytest.fixture(scope="session")
def launch_ray(ray_session):
    """The session's Ray (tests/conftest.py), with the test worker classes shipped by value."""
    ray_session.cloudpickle.register_pickle_by_value(slurm_test_workers)
    return ray_session


@pytest.fixture(scope="module")
def local_slurm():
    """A real single-node Slurm cluster (munged, slurmctld, slurmd) in a temp directory.

    Skipped when Debian's slurm-wlm/munge binaries are absent
    (``apt-get install -y --no-install-recommends slurm-wlm munge``).
    """
    missing = missing_binaries()
    if os.geteuid() != 0:
        pytest.skip("the single-node Slurm cluster runs slurmd as root (SlurmdUser=root); not root here")
    if missing:
        pytest.skip(f"Slurm/munge not installed (missing {', '.join(missing)}): "
                    "apt-get install -y --no-install-recommends slurm-wlm munge")
    with tempfile.TemporaryDirectory(prefix="megaflow-slurm-") as root:
        cluster = LocalSlurm(Path(root), cpus=2)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
