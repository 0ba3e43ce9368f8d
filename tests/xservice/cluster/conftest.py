"""Cluster tests: the module-scoped ``etcd`` fixture (a real etcd server, ``helpers.EtcdServer``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.xservice.cluster.helpers import EtcdServer


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd not installed: run ci/install_cluster_deps.sh")
    server = EtcdServer()
    server.start()
    yield server
    server.cleanup()
