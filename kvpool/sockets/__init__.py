"""Sending and receiving on non-blocking sockets from asyncio, on any event loop."""
