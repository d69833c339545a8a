"""A loopback TCP port forwarded to a Unix socket, byte for byte, as `ssh -L PORT:SOCKET` does
for an operator (docs/status-page.md): what lets a browser inside the sandbox load gpud's page.
gpud sees each connection come from this process (its uid and groups).

    python socket_proxy.py 127.0.0.1:8080 /run/gpud/gpud.sock
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def main(listen: str, socket_path: str) -> None:
    host, _, port = listen.rpartition(":")

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    server = await asyncio.start_server(forward, host, int(port))
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
