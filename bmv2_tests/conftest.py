"""The BMv2 suite: skipped, with one line saying why, where BMv2, p4c or Mininet are missing."""

from __future__ import annotations

import pytest

from .network import missing_requirements

MISSING = missing_requirements()


def pytest_collection_modifyitems(config, items):
    if MISSING:
        skip = pytest.mark.skip(reason=MISSING)
        for item in items:
            if "bmv2_tests" in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def pipeline():
    from passing_controller.p4runtime import Pipeline

    from .network import compile_p4

    p4info, device_config = compile_p4()
    return Pipeline(p4info, device_config)


@pytest.fixture(scope="module")
def network(request):
    from .network import Bmv2Network

    hosts = getattr(request.module, "HOSTS", 5)
    net = Bmv2Network(hosts)
    yield net
    net.stop()


@pytest.fixture(scope="module")
def switch(network, pipeline):
    from passing_controller import aggregator_address, l2_forward
    from passing_controller.session import Switch
    from passing_controller.topology import Topology

    sw = Switch(network.p4runtime_address)
    sw.set_pipeline(pipeline)
    topo = Topology.from_dict(network.topology())
    l2_forward.install(sw, topo)
    aggregator_address.install(sw, topo)
    yield sw
    sw.close()
