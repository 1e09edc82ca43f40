import asyncio
import socket

from kvpool.sockets.socket_input import SocketInput


def test_waits_for_input_and_keeps_the_socket_registered_between_waits():
    async def scenario():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        incoming = SocketInput(a)
        buf = bytearray(16)
        try:
            reading = asyncio.ensure_future(incoming.recv_into(buf))
            await asyncio.sleep(0)
            assert not reading.done() and incoming._watching  # waiting, registered
            b.send(b"hello")
            assert await asyncio.wait_for(reading, 5) == 5 and buf[:5] == b"hello"
            assert incoming._watching  # still registered: the next wait costs no syscall
            b.send(b"more")  # arrives while nobody waits: the next call finds it at once
            assert await asyncio.wait_for(incoming.recv_into(buf), 5) == 4 and buf[:4] == b"more"
            b.close()
            assert await asyncio.wait_for(incoming.recv_into(buf), 5) == 0  # peer closed
        finally:
            incoming.stop()
            assert not incoming._watching
            a.close()
        assert loop is asyncio.get_running_loop()

    asyncio.run(scenario())
