"""The floor reference for bench/compare.py: a bare aiohttp + uvloop proxy.

What a competent afternoon's proxy costs: one `web.Application` route that
forwards any request to one upstream through a shared `ClientSession` and
streams the answer back. No picking, no usage, no retries, no limits. If
the router is slower than this, its features cost more than they should.

    python bench/floor.py --port 8081 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

import aiohttp
import uvloop
from aiohttp import web

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}
)


def make_app(upstream: str) -> web.Application:
    session: aiohttp.ClientSession | None = None

    async def start(app: web.Application) -> None:
        nonlocal session
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )

    async def stop(app: web.Application) -> None:
        if session is not None:
            await session.close()

    async def forward(request: web.Request) -> web.StreamResponse:
        assert session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with session.request(request.method, upstream + request.path_qs, data=body, headers=headers) as resp:
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
            if resp.content_length is not None:
                return web.Response(status=resp.status, body=await resp.read(), headers=out_headers)
            out = web.StreamResponse(status=resp.status, headers=out_headers)
            await out.prepare(request)
            while chunk := await resp.content.readany():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL of the one replica")
    args = parser.parse_args()
    web.run_app(
        make_app(args.upstream.rstrip("/")),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )


if __name__ == "__main__":
    main()
