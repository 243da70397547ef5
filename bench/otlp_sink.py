"""An OTLP/HTTP traces endpoint that takes every export and keeps nothing: what tracing's cost is measured against.

    python bench/otlp_sink.py     # prints: otlp sink on http://127.0.0.1:PORT/v1/traces

Each POST's body is read whole and answered 200 with an empty
ExportTraceServiceResponse (an empty protobuf message is zero bytes), as a
collector that accepts everything does: the router's exporter does all of its
real work (encoding, the HTTP round trip) and none of a collector's.
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(BaseHTTPRequestHandler):
    """Reads each export and accepts it."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    print(f"otlp sink on http://127.0.0.1:{server.server_address[1]}/v1/traces", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
