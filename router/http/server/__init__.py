"""The client port's HTTP/1.1 server, on asyncio.Protocol and llhttp (httptools).

aiohttp's server spent, per short request, about as much CPU in Python as
the whole router's own logic: a request object with lazy properties, a task
and a response object per request, header multidicts both ways. The client
port needs a few routes of plain HTTP/1.1, so this package does only that,
and holds the line a hostile client pushes on. Its parts, each with its rules:

- head.py: a request head judged by RFC 9110 and 9112, a pure function
  (fields in, a Head or a Refusal out), fuzzed against h11 without sockets;
- states.py: the connection's state machine, its transitions as tables, and
  what follows an answer;
- connection.py: one connection, a composition: reads fed to llhttp (sliced
  behind a queued request), requests answered one at a time in order,
  deadlines acted on, closing;
- reader.py: what llhttp calls back, with the byte bounds on heads,
  trailers, chunk framing and bodies;
- intake.py: what is done with what the reader finds (the app's head check,
  the limits, 100 Continue, refusals answered in their turn), and reading
  anew after an ignored Upgrade;
- cycle.py: one request and its answer, its writer and its handler's run;
- writer.py: every byte of HTTP/1.1 framing the client port writes;
- flow.py: flow control both ways (answers not taken, bodies held);
- deadlines.py: one sweep for every connection's deadlines, and each one's read deadline;
- port.py: what every connection shares (handler, limits, sweep, request ids);
- server.py: the connections' factory, and shutdown.

No module of the package imports another in a circle: the parts reach each
other through small interfaces (Protocol classes) where they would.

Shutdown: stop accepting, close idle connections, let running requests finish
within the grace, then cancel them.
"""

from router.http.server.server import Server

__all__ = ["Server"]
