"""What a control port reply means to a client: the response, or the error it stands for.

Shared by both ways of calling the port (control_link.py, control_blocking.py).
"""

from kvpool.protocol import control
from kvpool.errors import Code, NotLeaderError, ProtocolError, UnavailableError, error_for

_OK, _NOT_LEADER = int(Code.OK), int(Code.NOT_LEADER)


class LeaderHint(NotLeaderError):
    """A master answered NOT_LEADER; it names the `leader` (gRPC) and its `control_address`
    ("" for what it does not know)."""

    def __init__(self, message: str, leader: str, control_address: str):
        super().__init__(message)
        self.leader = leader
        self.control_address = control_address


class NotSent(UnavailableError):
    """The call never reached the master: no connection, or one found closed before the frame left."""


def answer(address: str, method: str, status: int, body):
    """The response a reply frame carries, or raise the error it stands for."""
    if status == _OK:
        try:
            return control.MESSAGES[method][1].FromString(bytes(body))
        except Exception as exc:  # noqa: BLE001 - a garbled answer fails that call only
            raise ProtocolError(f"master {address} {method}: bad answer: {exc}") from None
    if status == _NOT_LEADER:
        leader, control_address = control.parse_not_leader(bytes(body))
        raise LeaderHint(f"master {address} {method}: not leader", leader, control_address)
    message = bytes(body).decode("utf-8", "replace")
    raise error_for(status, f"master {address} {method}: {message}")
