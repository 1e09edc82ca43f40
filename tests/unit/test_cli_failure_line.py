"""cli.failure_line on errors the end-to-end tests cannot easily provoke."""

from kvpool.commands.cli import failure_line
from kvpool.errors import NoSpaceError, UnavailableError


def test_an_unexpected_error_names_its_type_and_the_debug_switch():
    line = failure_line(TypeError("'NoneType' object is not subscriptable"), {})
    assert line.startswith("TypeError: 'NoneType' object is not subscriptable") and "--debug" in line


def test_a_kvpool_error_keeps_its_message():
    assert failure_line(NoSpaceError("no node has 64MiB free"), {}) == "no node has 64MiB free"


def test_a_master_that_died_mid_call_is_named():
    line = failure_line(UnavailableError("master 10.0.0.2:5000 Get: UNAVAILABLE: Connection reset by peer"), {})
    assert line.startswith("master 10.0.0.2:5000 closed the connection"), line


def test_a_message_over_several_lines_becomes_its_first_and_last():
    line = failure_line(RuntimeError("node-1 exited with 1:\nstarting\nmore log\ncannot bind 0.0.0.0:80"), {})
    assert line == "node-1 exited with 1: cannot bind 0.0.0.0:80"
