"""passing.torch units: Options (fields over PASSING_* variables over defaults), PassingWork."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from passing.torch import SCHEMES, OptionError, Options  # noqa: E402


def test_field_beats_environment_beats_default():
    env = {"PASSING_SCHEME": "psring", "PASSING_POOL": "32", "PASSING_SCALE": "1e8", "PASSING_HOST": "10.1.1.1",
           "PASSING_SERVER": "rack1-a"}
    o = Options(pool=64).resolve(env)
    assert (o.scheme, o.pool, o.scale, o.host, o.server) == ("psring", 64, 1e8, "10.1.1.1", "rack1-a")
    d = Options().resolve({"PASSING_HOST": "127.0.0.1", "GROUP_RANK": "3"})
    assert (d.scheme, d.scale, d.timeout, d.controller, d.embedded, d.server, d.report_interval, d.shared_memory) == (
        "passing", "auto", 300.0, None, "off", "3", 10.0, "/dev/shm")  # no controller, no embedded PS: gloo among
    # the peers, the in-host stage through /dev/shm
    assert Options().resolve({"PASSING_SHARED_MEMORY": "off"}).shared_memory == "off"


def test_host_defaults_to_the_route_toward_the_controller():
    assert Options(controller="tcp://127.0.0.1:9090").resolve({}).host == "127.0.0.1"


@pytest.mark.parametrize("env,message", [
    ({"PASSING_SCHEME": "allgather"}, "scheme must be one of"),
    ({"PASSING_POOL": "many"}, "not a number"),
    ({"PASSING_POOL": "0"}, "pool must be"),
    ({"PASSING_SCALE": "-1"}, "scale must be"),
    ({"PASSING_TIMEOUT": "0"}, "timeout must be positive"),
    ({"PASSING_ON_OVERFLOW": "ignore"}, "on_overflow"),
    ({"PASSING_REPORT_INTERVAL": "-1"}, "report_interval"),
    ({"PASSING_MTU": "40"}, "mtu must be 68..65536"),
    ({"PASSING_MTU": "jumbo"}, "not a number"),
    ({"PASSING_EMBEDDED": "switch"}, "embedded must be one of off, ps"),
    ({"PASSING_EMBEDDED": "ps", "PASSING_CONTROLLER": "tcp://127.0.0.1:9090"}, "set one or the other"),
    ({"PASSING_SHARED_MEMORY": "shm"}, "shared_memory must be 'off' or an absolute directory"),
    ({"PASSING_DEVICE_BACKEND": "mpi"}, "device_backend must be one of auto, nccl, gloo"),
    ({"PASSING_STREAMS": "17"}, "streams must be 1..16; got 17"),
    ({"PASSING_STREAMS": "two"}, "not a number"),
    ({"PASSING_STREAMS": "2", "PASSING_ENGINE": "numpy"}, "streams=2 needs the native engine"),
    ({"PASSING_LINK_GBIT": "-5"}, "link_gbit must be positive"),
])
def test_bad_values_are_refused_with_the_reason(env, message):
    with pytest.raises(OptionError, match=message):
        Options().resolve({"PASSING_HOST": "127.0.0.1", **env})


def test_streams_default_from_the_link_speed_only_where_it_is_given():
    from passing import native
    from passing.stripes import default_streams

    env = {"PASSING_HOST": "127.0.0.1"}
    assert Options().resolve(env).streams == 1  # no link speed: one stream
    assert Options().resolve({**env, "PASSING_STREAMS": "3"}).streams == 3
    link = Options().resolve({**env, "PASSING_LINK_GBIT": "12.5"})
    assert link.link_gbit == 12.5
    assert link.streams == (default_streams(12.5, 64) if native.available() else 1) >= (2 if native.available() else 1)
    assert Options(streams=1).resolve({**env, "PASSING_LINK_GBIT": "100"}).streams == 1  # given beats the default
    assert Options().resolve({**env, "PASSING_LINK_GBIT": "12.5", "PASSING_ENGINE": "numpy"}).streams == 1


def test_the_embedded_aggregator_takes_its_interface_mtu():
    """Rank 0's embedded PS: the MTU of the interface with its address (loopback's 65536), which sizes the
    packets (docs/control.md, Lanes), checked against /sys/class/net; PASSING_MTU overrides it."""
    import fcntl
    import socket
    import struct

    from passing.torch.embedded import DEFAULT_MTU, LOOPBACK_MTU, SIOCGIFADDR, interface_mtu

    assert interface_mtu("127.0.0.1") == LOOPBACK_MTU
    assert interface_mtu("192.0.2.250") == DEFAULT_MTU  # TEST-NET-1: on no interface here
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                address = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("16s16x", name.encode()))
                                           [20:24])
            except OSError:  # no IPv4 address
                continue
            if not address.startswith("127."):
                with open(f"/sys/class/net/{name}/mtu") as f:
                    assert interface_mtu(address) == int(f.read()), name
    assert Options(mtu=9000).resolve({"PASSING_HOST": "127.0.0.1"}).mtu == 9000


def test_schemes_are_design_7s_configurations():
    assert {k: (v.in_host, v.aggregator) for k, v in SCHEMES.items()} == {
        "passing": (True, "any"), "psring": (True, "ps"), "switchml": (False, "any"), "ps": (False, "ps"),
        "ring": (False, None)}


def test_work_reraises_the_operations_own_error_and_honours_a_timeout():
    import datetime

    from passing.errors import AggregatorUnreachable
    from passing.torch.work import PassingWork

    pending = PassingWork()
    with pytest.raises(TimeoutError):
        pending.wait(datetime.timedelta(seconds=0.02))
    assert not pending.is_completed()
    failed = PassingWork()
    failed.fail(AggregatorUnreachable("no RESULT for psn 7"))
    with pytest.raises(AggregatorUnreachable, match="psn 7"):
        failed.wait()
    assert failed.is_completed() and not failed.is_success()
    done = PassingWork()
    done.complete([torch.ones(1)])
    assert done.wait() and done.is_success() and done.get_future().value()[0].item() == 1.0


def test_a_failed_works_error_keeps_no_frames_so_nothing_it_passed_through_outlives_the_work():
    """A collective's error reaches the process group through its traceback's frames: kept with the work, it
    held a destroyed group (and rank 0's store) until the garbage collector ran (issue 45). The kept error has
    its traceback as a note; every wait raises a copy (type, message, attributes), the caller's traceback its own."""
    import gc
    import weakref

    from passing.errors import GroupFailed
    from passing.torch.work import InOrder, PassingWork

    class Stage:  # what a job's frames hold: a process group's stages
        def run(self) -> None:
            raise GroupFailed("no aggregator left", [2], [], None)

    stage = Stage()
    gone = weakref.ref(stage)
    runner = InOrder("units-failing")
    work = PassingWork(runner)
    runner.submit(work, stage.run, caller_waits=True)
    del stage
    gc.disable()  # what is let go must go by reference counts alone
    try:
        for _ in range(2):
            with pytest.raises(GroupFailed, match="no aggregator left") as raised:
                work.wait()
            assert raised.value is not work.exception() and raised.value.dead == [2]
        del raised
        assert gone() is None, "the failed job's frames still hold what they held"
    finally:
        gc.enable()
        runner.shutdown()
    kept = work.exception()
    assert kept.__traceback__ is None and any("in run" in note for note in kept.__notes__), kept.__notes__


def test_collectives_run_in_issue_order_and_a_waiting_caller_runs_the_next_itself():
    """passing.torch.work.InOrder: queued collectives run one at a time in issue order; waiting
    on the next one before the group's thread has taken it runs it in the waiting thread, and so
    does issuing one with async_op=False when nothing is before it; waiting on a later one leaves
    the earlier ones first; shutdown runs what is queued."""
    import threading

    from passing.torch.work import InOrder, PassingWork

    ran: list[tuple[str, str]] = []
    started, gate = threading.Event(), threading.Event()

    def job(name: str, work: PassingWork, hold: bool = False):
        def run() -> None:
            if hold:
                started.set()
                gate.wait(10)
            ran.append((name, threading.current_thread().name))
            return [name]
        return run

    runner = InOrder("pg-test")
    first, second, third = PassingWork(runner), PassingWork(runner), PassingWork(runner)
    runner.submit(first, job("first", first, hold=True))
    assert started.wait(10)  # the group's thread has it, and holds
    runner.submit(second, job("second", second))
    runner.submit(third, job("third", third))
    assert not runner.run_here(second) and not runner.run_here(third)  # one runs: they wait their turn
    gate.set()
    assert third.wait() and [name for name, _ in ran] == ["first", "second", "third"]
    assert all(thread == "pg-test" for _, thread in ran), ran

    ran.clear()
    fourth = PassingWork(runner)
    with runner._changed:  # the group's thread cannot take it before this thread asks
        assert runner._changed.wait_for(lambda: not runner._running, 10)  # done with "third" (its finally)
        runner.submit(fourth, job("fourth", fourth))
        assert runner.run_here(fourth)
    assert ran == [("fourth", threading.current_thread().name)] and fourth.wait()

    ran.clear()  # async_op=False: run in the caller's thread when nothing is before it, else in turn
    started.clear()
    gate.clear()
    held, waited, now = PassingWork(runner), PassingWork(runner), PassingWork(runner)
    runner.submit(held, job("held", held, hold=True))
    assert started.wait(10)
    runner.submit(waited, job("waited", waited), caller_waits=True)
    assert not waited.is_completed()  # queued behind the one running
    gate.set()
    assert waited.wait() and [name for name, _ in ran] == ["held", "waited"]
    with runner._changed:
        assert runner._changed.wait_for(lambda: not runner._running, 10)
    runner.submit(now, job("now", now), caller_waits=True)
    assert now.is_completed() and ran[-1] == ("now", threading.current_thread().name)

    fifth = PassingWork(runner)
    runner.submit(fifth, job("fifth", fifth))
    runner.shutdown()
    assert fifth.is_completed() and fifth.get_future().value() == ["fifth"]
    with pytest.raises(RuntimeError, match="shut down"):
        runner.submit(PassingWork(runner), job("late", PassingWork()))


def test_a_callback_may_issue_and_wait_on_a_collective_and_holds_up_nothing_else():
    """PowerSGD's hook waits, inside a `then` callback, on a collective it issues: the future of a work is
    completed once the work has left the queue, never on the group's thread, and a callback that blocks
    holds its own completion thread only (before issue 35 the first of these hung for good)."""
    import threading

    from passing.torch.work import InOrder, PassingWork

    runner = InOrder("pg-callbacks")
    threads: dict[str, str] = {}

    def issue(name: str, release: threading.Event | None = None) -> PassingWork:
        """A collective; with ``release``, one that runs once the test has set it (so that its callback is
        attached before it completes, and runs where the backend puts it, not inline in this thread)."""
        work = PassingWork(runner)

        def job() -> list[str]:
            if release is not None:
                assert release.wait(60)
            threads.setdefault(name, threading.current_thread().name)
            return [name]

        runner.submit(work, job)
        return work

    def chained(fut):  # a callback that issues a collective and waits on it, as compute_qs does
        threads["callback"] = threading.current_thread().name
        return fut.value() + issue("inner").get_future().wait()

    go = threading.Event()
    outer = issue("outer", go).get_future().then(chained)
    go.set()
    assert outer.wait() == ["outer", "inner"]
    assert threads["outer"] == threads["inner"] == "pg-callbacks"
    assert threads["callback"] not in ("pg-callbacks", threading.current_thread().name)

    # A callback that blocks: the next collective runs and completes meanwhile, on another thread.
    gate, blocked = threading.Event(), threading.Event()

    def block(fut):
        threads["block"] = threading.current_thread().name
        blocked.set()
        gate.wait(120)
        return fut.value()

    go = threading.Event()
    held = issue("held", go).get_future().then(block)
    go.set()
    assert blocked.wait(60)
    assert threads["block"] not in ("pg-callbacks", threading.current_thread().name)
    after = issue("after")
    assert after.get_future().wait() == ["after"] and not held.done()
    gate.set()
    assert held.wait() == ["held"]

    # An error reaches the callback and whoever waits; a callback's own error is its future's.
    failing = PassingWork(runner)
    runner.submit(failing, lambda: (_ for _ in ()).throw(ValueError("lost")))
    with pytest.raises(ValueError, match="lost"):
        failing.wait()
    runner.shutdown()
