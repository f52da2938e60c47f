"""Where the executors reach a Spark Connect client whose server is on the client's loopback."""
import socket

import pytest

from horovod_spark._job.cluster import loopback_client


def _own_address():
    """An address of this machine that is not loopback (the one its default route uses)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent
            return s.getsockname()[0]
    except OSError:
        return None


def test_a_local_master_reaches_the_client_on_loopback():
    assert loopback_client("local[2]", "10.0.0.5") == ("127.0.0.1", True)
    assert loopback_client("local-cluster[2,1,1024]", "") == ("127.0.0.1", True)


def test_a_cluster_driven_from_this_machine_reaches_the_client_at_the_drivers_host():
    own = _own_address()
    if own is None or own.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    assert loopback_client("spark://10.0.0.1:7077", own) == (own, True)


def test_a_server_behind_a_tunnel_cannot_reach_the_client():
    # sc://localhost through a tunnel: the server's driver host is not this machine's
    assert loopback_client("spark://192.0.2.1:7077", "192.0.2.1") == (None, False)
    assert loopback_client("yarn", "127.0.0.1") == (None, False)
