"""router/scaler/externalscaler.proto: wire-compatible with KEDA's, and the committed modules generated from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from router.scaler import externalscaler_pb2

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [
    "externalscaler_pb2.py",
    "externalscaler_pb2.pyi",
    "externalscaler_pb2_grpc.py",
    "externalscaler_pb2_grpc.pyi",
]

# KEDA's interface: (rpc, request, response, server streams).
METHODS = [
    ("IsActive", "ScaledObjectRef", "IsActiveResponse", False),
    ("StreamIsActive", "ScaledObjectRef", "IsActiveResponse", True),
    ("GetMetricSpec", "ScaledObjectRef", "GetMetricSpecResponse", False),
    ("GetMetrics", "GetMetricsRequest", "GetMetricsResponse", False),
    ("StreamMetricSpec", "ScaledObjectRef", "GetMetricSpecResponse", True),
]
T = FieldDescriptor
# message -> [(field, number, type, repeated, message type)]
FIELDS: dict[str, list[tuple[str, int, int, bool, str | None]]] = {
    "ScaledObjectRef": [
        ("name", 1, T.TYPE_STRING, False, None),
        ("namespace", 2, T.TYPE_STRING, False, None),
        ("scalerMetadata", 3, T.TYPE_MESSAGE, True, "ScaledObjectRef.ScalerMetadataEntry"),
    ],
    "IsActiveResponse": [("result", 1, T.TYPE_BOOL, False, None)],
    "GetMetricSpecResponse": [("metricSpecs", 1, T.TYPE_MESSAGE, True, "MetricSpec")],
    "MetricSpec": [
        ("metricName", 1, T.TYPE_STRING, False, None),
        ("targetSize", 2, T.TYPE_INT64, False, None),
        ("targetSizeFloat", 3, T.TYPE_DOUBLE, False, None),
    ],
    "GetMetricsRequest": [
        ("scaledObjectRef", 1, T.TYPE_MESSAGE, False, "ScaledObjectRef"),
        ("metricName", 2, T.TYPE_STRING, False, None),
    ],
    "GetMetricsResponse": [("metricValues", 1, T.TYPE_MESSAGE, True, "MetricValue")],
    "MetricValue": [
        ("metricName", 1, T.TYPE_STRING, False, None),
        ("metricValue", 2, T.TYPE_INT64, False, None),
        ("metricValueFloat", 3, T.TYPE_DOUBLE, False, None),
    ],
}


def test_the_service_and_its_methods_are_keda_s_on_the_wire() -> None:
    file = externalscaler_pb2.DESCRIPTOR
    assert file.package == "externalscaler"
    assert 'syntax = "proto3";' in (ROOT / "router" / "scaler" / "externalscaler.proto").read_text()
    service = file.services_by_name["ExternalScaler"]
    assert service.full_name == "externalscaler.ExternalScaler"
    found = [
        (m.name, m.input_type.name, m.output_type.name, m.server_streaming)
        for m in service.methods
        if not m.client_streaming
    ]
    assert found == METHODS
    assert not any(m.client_streaming for m in service.methods)


@pytest.mark.parametrize("message", FIELDS)
def test_each_message_has_keda_s_field_names_numbers_and_types(message: str) -> None:
    descriptor = externalscaler_pb2.DESCRIPTOR.message_types_by_name[message]
    assert descriptor.full_name == f"externalscaler.{message}"
    found = [
        (
            f.name,
            f.number,
            f.type,
            f.is_repeated,
            f.message_type.full_name.removeprefix("externalscaler.") if f.message_type else None,
        )
        for f in descriptor.fields
    ]
    assert found == FIELDS[message]


def test_scaler_metadata_is_a_map_of_strings() -> None:
    entry = externalscaler_pb2.ScaledObjectRef.DESCRIPTOR.fields_by_name["scalerMetadata"].message_type
    assert entry is not None and entry.GetOptions().map_entry
    assert [(f.name, f.number, f.type) for f in entry.fields] == [
        ("key", 1, T.TYPE_STRING),
        ("value", 2, T.TYPE_STRING),
    ]


def test_the_committed_modules_are_what_the_proto_generates(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "gen-proto"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in GENERATED:
        fresh = (tmp_path / "router" / "scaler" / name).read_text()
        committed = (ROOT / "router" / "scaler" / name).read_text()
        assert fresh == committed, f"router/scaler/{name} is stale: run `make proto` and commit it"
