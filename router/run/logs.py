"""Every log line a request causes names its request id.

The id (the client's X-Request-Id, or one the server made) is found from the
task that writes the line (router.http.server.running_request); the filter below
adds it to the record's message, so `replica r0 broke off an answer` reads
`[req 9f3a1c0e-12] replica r0 broke off an answer` without every call site
passing it along, and without a cost per request: only a line written pays.
"""

from __future__ import annotations

import logging

from router.http.server import running_request


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None):
            return True  # another handler's filter named it already
        request = running_request()
        if request is not None and request.request_id:
            rid = request.request_id.decode("ascii")
            record.request_id = rid
            record.msg = f"[req {rid}] {record.msg}"
        return True


def install(handler: logging.Handler) -> None:
    handler.addFilter(RequestIdFilter())
