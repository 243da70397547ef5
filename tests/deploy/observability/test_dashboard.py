"""deploy/grafana/router.json has the structure of Grafana's own dashboards (no Grafana is installable here).

What is checked is the classic dashboard JSON model as Grafana's documentation
("Dashboard JSON model") describes it and as the engines' shipped dashboards
have it (vLLM's examples/online_serving/prometheus_grafana/grafana.json, the
vLLM production-stack's observability/vllm-dashboard.json): a schemaVersion,
panels placed on the 24-column grid with their own ids, Prometheus targets with
refIds, a datasource variable that every panel and target names, and a query
variable. tests/deploy/observability/test_prometheus.py runs every query.
"""

from __future__ import annotations

import re

from tests.deploy.observability.dashboard import BUILT_IN, load, panels, queries

PANEL_TYPES = {"timeseries", "table", "bargauge", "stat", "state-timeline", "row"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_the_dashboard_is_a_grafana_dashboard_of_a_known_schema() -> None:
    doc = load()
    assert isinstance(doc["schemaVersion"], int) and 36 <= doc["schemaVersion"] <= 41
    assert doc["title"] == "router" and doc["uid"] == "router-overview"
    # Importable anywhere: no id of the Grafana it came from, no pinned data source.
    assert doc["id"] is None
    assert "__inputs" not in doc
    for key in ("annotations", "editable", "panels", "templating", "time", "refresh", "tags", "version"):
        assert key in doc, key


def test_variables_are_a_datasource_and_a_model_chosen_from_the_routers_series() -> None:
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    assert set(variables) == {"datasource", "model"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query" and model["datasource"] == DATASOURCE
    assert model["query"]["query"] == model["definition"] == 'label_values({__name__=~"router_.+"}, model)'
    assert model["multi"] is True and model["includeAll"] is True
    # No allValue: "All" is every value found, so `model=~"$model"` never matches a series without the label.
    assert model.get("allValue") is None


def test_every_panel_sits_on_the_grid_without_overlap_and_has_its_own_id() -> None:
    doc = load()
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in grid.values())
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        columns = range(grid["x"], grid["x"] + grid["w"])
        cells = {(x, y) for x in columns for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_panel_reads_the_chosen_datasource_and_says_what_it_shows() -> None:
    for panel in panels(load()):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_queries_use_only_defined_variables_and_a_rate_window_grafana_sizes() -> None:
    names = {"$" + v["name"] for v in load()["templating"]["list"]}
    for query in queries(load()):
        used = set(re.findall(r"\$\{?(\w+)", query.expr))
        assert {"$" + u for u in used} <= names | set(BUILT_IN), (query.panel, used)
        # A fixed window would show nothing at a scrape interval longer than it.
        assert not re.search(r"\[\d+[smh]\]", query.expr), query.panel


def test_the_dashboard_covers_what_an_operator_looks_at() -> None:
    """Every family an operator of the fleet looks at is on some panel."""
    text = " ".join(q.expr for q in queries(load()))
    for metric in (
        "router_requests_total",
        "router_upstream_errors_total",
        "router_request_duration_seconds_bucket",
        "router_time_to_first_byte_seconds_bucket",
        "router_replica_in_flight_requests",
        "router_replica_quiet_seconds",
        "router_replica_state",
        "router_replica_last_used_timestamp_seconds",
        "router_held_requests",
        "router_hold_outcomes_total",
        "router_wake_calls_total",
        "router_affinity_total",
        "router_upstream_protocol_errors_total",
        "router_client_protocol_errors_total",
        "router_retries_total",
        "router_fallbacks_total",
        "router_queue_wait_seconds_bucket",
        "router_queued_requests",
        "router_discovery_stale_seconds",
        "router_workers",
        "router_worker_in_flight_requests",
        "router_scaler_active",
        "router_scaler_requests",
    ):
        assert metric in text, metric
