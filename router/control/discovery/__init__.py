"""Kubernetes discovery: the replica set from EndpointSlices (and Pods), right through every watch failure.

    parse.py    objects in, replicas or a verdict out: pure, no I/O, no event
                loop (fuzzed and tested without an API server)
    access.py   where the API server is (service account, kubeconfig) and a client of it
    api.py      its answers: list bodies, errors, Gone
    watch.py    one kind of object listed and watched: reconnects, relists, staleness
    source.py   the replica-set source: the watches' views joined and applied to
                the fleet, and the discovery metrics

Nothing is imported here, so that the pure parse loads without the
Kubernetes client; `router.control.sources` imports the source only where
discovery is on.
"""
