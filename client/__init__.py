"""The library inference engines call: Client (blocking) and AsyncClient (asyncio)."""

from kvpool.client.aio import AsyncClient
from kvpool.client.sync import Client

__all__ = ["Client", "AsyncClient"]
