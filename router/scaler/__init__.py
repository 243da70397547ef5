"""`router scaler`: KEDA's external push scaler, fed by every router's usage map.

KEDA scales a Deployment between 0 and N on the answers of an external
scaler, a gRPC server (externalscaler.proto beside this file). This one
polls every router's admin API, merges the maps with the rules of `router ctl
idle` (router.core.usage.snapshots.merge_reports: the proven quiet bound; a router that does
not answer makes the merge incomplete) and answers per model:

- `settings.py`  the `[scaler]` table and the command line, validated once
- `view.py`      one poll round's facts per model, and what KEDA is told from them (pure)
- `poller.py`    the rounds: every router's usage and replicas, over HTTP
- `board.py`     the newest view, the wake hints, and the changes streams wait for
- `sleeper.py`   sleepAfter: a replica proven quiet put to sleep, fenced at every router first
- `service.py`   the gRPC service KEDA calls
- `http_api.py`  /healthz, /metrics and POST /wake (the routers' `wake_url`)
- `main.py`      the command: wiring, signals

The generated `externalscaler_pb2*` modules are committed; `make proto`
regenerates them.
"""
