"""What the tests share, in one place: clients, waits, processes, stand-ins for the world around a router.

clients.py       a real client's calls: requests, usage and admin documents, metrics, `router ctl`
waiting.py       waiting for an event, not for time: `wait_for`, `until` (async checks), `tick`, `until_cancelled`
processes.py     `Serve` (`router serve` on port 0), `said`, `held_socket`/`held_port`, `free_port`
raw_server.py    raw HTTP servers standing in for replicas, counting connections and requests
upstream.py      the upstream client's tests' parts: clients made per test, a recording sink
wire.py          misbehaving replicas and a raw client connection, written byte by byte
clock.py         `FakeClock`: the core's clock on fake time, moved by the test
loops.py         which loop each test runs on, and its deadline there (pytest hooks)
http_harness.py  the client port's server alone, with a stub handler
streams.py       hypothesis strategies for request streams
differential.py  the differential HTTP/1.1 checks: a live server's answers against h11_reference.py's
h11_reference.py what h11 (with a lenient reading) makes of a request stream
scaler.py        the scaler's tests' routers, canned admin APIs and a gRPC client as KEDA's
refusing_router.py a router's admin API that fences a replica but refuses to be told it sleeps
keda_standin.py  KEDA's stand-in, run as a process (python -m tests.support.keda_standin)
manifests.py     the rendered deploy/ manifests
receiver.py      deploy/scale-from-zero/wake_receiver.py as a test's process
kube_api.py      a fake Kubernetes API server: lists, watches, bookmarks, 410 Gone
otlp.py          an OTLP/HTTP traces receiver that decodes the spans it gets; slow or failing on demand
programs.py      the outside programs a test needs (Prometheus, promtool), found or skipped
redis.py         a real redis-server per test (or a skip saying it is missing), and Redis fakes on raw sockets

Left beside their one area: the discovery harness and its recordings
(tests/control/discovery/), the Prometheus and dashboard readers
(tests/deploy/observability/), podman (tests/deploy/container/).
"""
