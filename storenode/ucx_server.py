"""The node's UCX endpoint (optional extra kvpool[ucx]): the data protocol over ucxx."""

import logging

log = logging.getLogger(__name__)


class UcxServer:
    offer: dict = {}

    async def stop(self) -> None:
        pass


async def start_ucx(store, server, host: str) -> UcxServer | None:
    """A running UCX endpoint for this node, or None (logged) when UCX cannot be used here."""
    log.info("UCX transport not available in this build")
    return None
