"""The client port's HTTP/1.1 server, on asyncio.Protocol and llhttp (httptools).

aiohttp's server spent, per short request, about as much CPU in Python as
the whole router's own logic: a request object with lazy properties, a task
and a response object per request, header multidicts both ways. The client
port needs a few routes of plain HTTP/1.1, so this package does only that,
and holds the line a hostile client pushes on. Its parts, each with its rules:

- head.py: a request head judged by RFC 9110 and 9112, a pure function
  (fields in, a Head or a Refusal out), fuzzed against h11 without sockets;
- states.py: a connection's two states and every change of them, as tables;
- reader.py, intake.py, connection.py: one connection, in three layers of one
  object: llhttp's callbacks with the byte bounds on heads, trailers, chunk
  framing and bodies; reads fed to them (sliced behind a queued request, read
  anew after an ignored Upgrade) and what is done with what they find (the
  app's head check, the limits, 100 Continue, refusals answered in their
  turn); requests answered one at a time in order, deadlines acted on, closing;
- cycle.py: one request's run, from its handler to its answer made whole;
- writer.py: every byte of HTTP/1.1 framing the client port writes;
- flow.py: flow control both ways (answers not taken, bodies held);
- deadlines.py: one sweep for every connection's deadlines;
- server.py: the connections, their handler and limits, shutdown.

Shutdown: stop accepting, close idle connections, let running requests finish
within the grace, then cancel them.
"""

from router.http.server.server import Server

__all__ = ["Server"]
