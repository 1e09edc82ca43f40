"""The library inference engines call: Client (blocking) and AsyncClient (asyncio)."""
