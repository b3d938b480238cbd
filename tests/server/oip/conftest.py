"""tritonclient's HTTP and gRPC clients for the module's own ``server`` fixture (an OipServer)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from dspark.server.oip.launch import OipServer


@pytest.fixture(scope="module")
def http(server: OipServer) -> Iterator[Any]:
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_(server: OipServer) -> Iterator[Any]:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield c
    c.close()
