"""The per-request histograms read as prometheus_client's own would, for the same observations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.gateway.metrics import ModelHistogram

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def parsed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the `_created` ones (when a series began, which ours does not say)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


# Values on the bounds themselves included: `le` is inclusive.
values = st.one_of(st.sampled_from(BOUNDS), st.floats(0, 100, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "ü m"]), values), max_size=60))
def test_the_same_observations_give_the_same_samples_as_prometheus_clients_histogram(
    observed: list[tuple[str, float]],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = ModelHistogram("router_time_to_first_byte_seconds", "From arrival.", BOUNDS, ours)
    reference = Histogram(
        "router_time_to_first_byte_seconds", "From arrival.", ["model"], registry=theirs, buckets=BOUNDS
    )
    for model, value in observed:
        histogram.observe(model, value)
        reference.labels(model).observe(value)
    mine, expected = parsed(ours), parsed(theirs)
    assert mine.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(mine[key] - value) <= 1e-9 * max(1.0, abs(value)), key
