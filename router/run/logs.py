"""Every log line a request causes names its request id.

The id (the client's X-Request-Id, or one the server made) is set by the
server in a ContextVar as the request's handler starts, in the request's own
task (router.http.messages.current_request_id), once per request; the filter
below adds it to the record's message, so `replica r0 broke off an answer`
reads `[req 9f3a1c0e-12] replica r0 broke off an answer` without every call
site passing it along. A protocol error's line names no request (it is the
connection's, or the replica's): it says so itself (`request_id` None).

Only a line written in a task is the request's: a callback (a transport's
read, a timer such as the deadline sweep) runs in a copy of the context it
was scheduled or created in, which may be a request's task that has long
moved on, and what it logs is no request's.
"""

from __future__ import annotations

import asyncio
import logging

from router.http.messages import current_request_id


class RequestIdFilter(logging.Filter):
    """Puts the request id of the task that logs into each log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "request_id" in record.__dict__:
            return True  # named already: by another handler's filter, or as no request's
        request_id = current_request_id.get()
        if request_id and _in_a_task():
            rid = request_id.decode("ascii")
            record.request_id = rid
            record.msg = f"[req {rid}] {record.msg}"
        return True


def _in_a_task() -> bool:
    try:
        return asyncio.current_task() is not None
    except RuntimeError:  # no running loop: no request either
        return False


def install(handler: logging.Handler) -> None:
    handler.addFilter(RequestIdFilter())
