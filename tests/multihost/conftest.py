"""The hosts of a multihost test: network namespaces on a bridge (netns_hosts.py), made for each test."""

import pytest
from netns_hosts import Network, unavailable


@pytest.fixture
def network():
    why = unavailable()
    if why:
        pytest.skip(f"hosts made of network namespaces are not available here: {why}")
    with Network() as net:
        yield net
