"""kvpool/net/netutil.py ConnectAttempt: the one tail of every connection attempt (nodes, control port)."""

import errno
import socket

import pytest

from kvpool.errors import ForbiddenError, UnavailableError
from kvpool.net.netutil import ConnectAttempt


def test_a_failed_attempt_closes_its_socket_and_names_what_it_tried():
    sock = socket.socket()
    with pytest.raises(UnavailableError, match=r"^node 10\.0\.0\.1:9: cannot connect: Connection refused$"):
        with ConnectAttempt("node 10.0.0.1:9", UnavailableError) as attempt:
            attempt.sock = sock
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    assert sock.fileno() == -1


def test_a_timeout_names_the_time_and_kvpool_errors_go_on_unchanged():
    with pytest.raises(UnavailableError, match="connect timed out after 3s"):
        with ConnectAttempt("node a:1", UnavailableError, 3):
            raise TimeoutError()
    refusal = ForbiddenError("node a:1 refused our credential")
    with pytest.raises(ForbiddenError) as caught:
        with ConnectAttempt("node a:1", UnavailableError):
            raise refusal
    assert caught.value is refusal


def test_a_socket_handed_on_is_left_open():
    sock = socket.socket()
    try:
        with pytest.raises(UnavailableError):
            with ConnectAttempt("master control port a:1", UnavailableError) as attempt:
                attempt.sock = sock
                attempt.sock = None  # its new owner closes it
                raise OSError(errno.ECONNRESET, "reset")
        assert sock.fileno() != -1
    finally:
        sock.close()
