"""Packaging: the controller's switch control (p4runtime-shell, gRPC, protobuf) is the optional
extra `passing-controller[switch]`. The PS-only controller, and the torch backend's embedded
controller and aggregator, import none of it; a topology with a switch and no extra is a clear
error that names the extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cluster.local import REPO

SWITCH_ONLY = ("p4runtime_sh", "grpc", "google.protobuf", "p4.v1", "p4.config")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(150)
def test_the_embedded_path_imports_no_switch_control():
    """Rank 0's embedded controller and aggregator start, admit and stop without loading any of it."""
    done = run(f"""
        import sys
        pytest_torch = __import__("importlib").util.find_spec("torch")
        from passing_controller import cli, service, topology  # the PS-only controller, and its CLI
        from passing.aggregator.server import SoftwareAggregator
        from passing.keys import Ephemeral
        from passing_controller.keys import ServerKeys
        from passing_controller.service import Controller
        from passing_controller.topology import Topology
        keys = Ephemeral()
        agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", keys=keys.aggregator())
        topo = Topology.from_dict({{"ps": [{{"data": "127.0.0.1:%d" % agg.address[1],
                                            "control": agg.control_endpoint}}]}})
        ctl = Controller(topo, None, ":memory:", "tcp://127.0.0.1:*",
                         ServerKeys(*keys.pairs["controller"], {{keys.public("worker"): "worker"}}))
        ctl.close(); agg.close()
        if pytest_torch is not None:
            from passing.torch import embedded  # noqa: F401  the backend's embedded mode
        loaded = sorted(m for m in sys.modules if m.startswith({SWITCH_ONLY!r}))
        print("LOADED", loaded)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED []" in done.stdout, done.stdout


@pytest.mark.timeout(150)
def test_a_switch_without_the_extra_names_it():
    """p4runtime-shell made unimportable (as if the extra were not installed): the controller refuses a
    topology with a switch at start, with the pip line, and passing-controller exits 2 saying so."""
    done = run("""
        import sys
        sys.modules["p4runtime_sh"] = None  # import p4runtime_sh now raises ImportError
        import zmq
        from passing_controller.keys import ServerKeys
        from passing_controller.p4runtime import SwitchSupportMissing
        from passing_controller.service import Controller
        from passing_controller.topology import Topology
        topo = Topology.from_dict({"switch": {"p4runtime": "127.0.0.1:1", "aggregation_mac": "02:00:00:00:00:fe",
                                              "aggregation_ip": "10.0.0.254"},
                                   "hosts": [{"name": "h1", "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "port": 1}]})
        try:
            keys = ServerKeys(*zmq.curve_keypair(), {b"x" * 40: "worker"})
            Controller(topo, None, ":memory:", "tcp://127.0.0.1:*", keys)
        except SwitchSupportMissing as e:
            print("REFUSED", e)
        from passing_controller import cli
        sys.argv = ["passing-controller"]
        import json, pathlib, tempfile
        path = pathlib.Path(tempfile.mkdtemp()) / "topo.json"
        path.write_text(json.dumps({"switch": {"p4runtime": "127.0.0.1:1", "aggregation_mac": "02:00:00:00:00:fe",
                                               "aggregation_ip": "10.0.0.254"}, "hosts": []}))
        print("EXIT", cli.controller_main(["--topology", str(path), "--store", ":memory:",
                                          "--listen", "tcp://127.0.0.1:*"]))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "pip install 'passing-controller[switch]'" in done.stdout, done.stdout
    assert "EXIT 2" in done.stdout and "passing-controller[switch]" in done.stderr, (done.stdout, done.stderr)


def test_the_switch_extra_is_declared():
    import tomllib

    meta = tomllib.loads((REPO / "controller" / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("p4runtime-shell") for d in meta["dependencies"])
    assert any(d.startswith("p4runtime-shell") for d in meta["optional-dependencies"]["switch"])
    assert "controller[test,switch]" in (REPO / "Makefile").read_text()  # make setup installs everything


def test_host_and_controller_share_the_protocol_package_and_not_each_other():
    """The CURVE keys, control messages and metrics server are one package, passing-protocol, that both
    distributions depend on; the controller depends on no host agent (numpy, the C data path) and loads
    none of it."""
    import tomllib

    def dependencies(directory: str) -> list[str]:
        return tomllib.loads((REPO / directory / "pyproject.toml").read_text())["project"]["dependencies"]

    assert "passing-protocol" in dependencies("host") and "passing-protocol" in dependencies("controller")
    assert not any(d.split("[")[0].strip() == "passing" for d in dependencies("controller"))
    assert "-e protocol" in (REPO / "Makefile").read_text()
    done = run("""
        import sys
        from passing_controller import cli, metrics, ps_control, schema, serve, service, top  # noqa: F401
        from passing_protocol.rpc import MessageError
        assert issubclass(schema.RequestError, MessageError)
        print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("passing", "numpy")))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED []" in done.stdout, done.stdout
