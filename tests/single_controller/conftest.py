"""Fixtures of the single-controller tests."""
import pytest

import single_controller_workers


@pytest.fixture(scope="session")
def sc_ray(ray_session):
    """The session's Ray (tests/conftest.py), with the test worker classes shipped by value."""
    ray_session.cloudpickle.register_pickle_by_value(single_controller_workers)
    return ray_session
