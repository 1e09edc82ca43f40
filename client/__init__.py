"""The library inference engines call: Client (blocking) and AsyncClient (asyncio)."""

from .aio import AsyncClient
from .sync import Client

__all__ = ["Client", "AsyncClient"]
