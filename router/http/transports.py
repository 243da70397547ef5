"""What the router does to a transport that asyncio's interface leaves to the socket: a reset.

`transport.abort()` closes the descriptor at once, but a peer that has
stopped reading (its window shut) leaves the kernel holding what was
written: an orphaned socket with megabytes unsent, retried for minutes.
A peer cut off for taking nothing is reset instead (SO_LINGER with a zero
timeout: the close sends RST and drops the unsent bytes), as nginx's
`reset_timedout_connection` does. Works on asyncio's transports and on
uvloop's (whose socket is a stand-in that still takes socket options).
"""

from __future__ import annotations

import asyncio
import socket
import struct

# struct linger {int l_onoff; int l_linger;}: on, zero seconds.
_RESET = struct.pack("ii", 1, 0)


def reset(transport: asyncio.Transport) -> None:
    """Abort `transport` with a TCP reset: nothing it still holds is sent."""
    sock = transport.get_extra_info("socket")
    if sock is not None and not transport.is_closing():
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            # Not a TCP socket, or already gone: the abort alone does what can be done.
            pass
    transport.abort()
