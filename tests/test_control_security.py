"""The control plane under attack (docs/security.md): each attack of issue 21 tried as an attacker
on the same machine would, against real processes (`passing-controller`, `passing-aggregator`)
in their default configuration. Every one fails for the attacker, and neither process dies."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from cluster.local import BIN, free_tcp_port
from passing import Group
from passing.aggregator.control_channel import ControlClient
from passing.control import ControllerError, join, leave, request
from passing.launch import free_udp_ports
from passing_protocol import rpc
from passing_protocol.keys import ClientKeys, KeysError
from tests.cluster import run_threads, start_aggregator, start_controller
from tests.keys import ask

WORKER = ClientKeys.load  # the session's worker key: what every job's workers hold


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def raw_request(endpoint: str, frames: list[bytes], keys: ClientKeys | None, timeout: float = 5.0,
                kind: int = zmq.REQ) -> dict | None:
    """Send ``frames`` as they are; the reply, or None when none comes."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            keys.apply(sock)
        sock.connect(endpoint)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            return None
        parts = sock.recv_multipart()
        return json.loads(parts[-1])
    finally:
        sock.close()


@pytest.fixture
def services(tmp_path):
    """A PS and a controller, as processes in their default configuration (loopback, keys from
    $PASSING_KEYS), and a job of two workers that keeps streaming until the test is over."""
    agg, ready = start_aggregator()
    # (a join timeout short enough that a hostile join that waits for its group is answered within a test)
    ctl, ctl_ready = start_controller({"ps": [{"data": ready["data"], "control": ready["control"]}]}, tmp_path,
                                      f"tcp://127.0.0.1:{free_tcp_port()}", ["--join-timeout", "5"])
    job = RunningJob(ctl_ready["endpoint"], "victim")
    try:
        out = {"controller": ctl_ready["endpoint"], "ps": ready, "ctl_proc": ctl, "ps_proc": agg, "job": job,
               "must_live": [ctl, agg]}
        yield out
        job.finish()
        assert all(p.poll() is None for p in out["must_live"]), "a service died"
    finally:
        if job.target is None:
            job.target = max(job.calls) + 1
        for p in (ctl, agg):
            p.terminate()
            p.wait(10)


class RunningJob:
    """Two workers joined through the controller, calling allreduce until ``finish``; every result
    is checked, so an attack that touched the job's sums fails the test."""

    def __init__(self, controller: str, name: str, workers: int = 2) -> None:
        self.controller, self.name, self.workers = controller, name, workers
        self.stop = threading.Event()
        self.target: int | None = None  # calls every worker makes in all, once the job is told to finish
        self.joined = threading.Barrier(workers + 1)
        self.answers: dict[int, dict] = {}
        self.calls = [0] * workers
        self.ports = free_udp_ports(workers)
        self.thread = threading.Thread(target=lambda: setattr(self, "outcome", run_threads(self._work, workers, 600)))
        self.thread.start()
        self.joined.wait(60)

    @staticmethod
    def data(worker: int, call: int) -> np.ndarray:
        return ((np.arange(5000) * (worker + 3) + call * 7919) % 2001 - 1000).astype(np.int32)

    def _work(self, w: int) -> int:
        answer = join(self.controller, self.name, w, self.workers, host="127.0.0.1", udp_port=self.ports[w],
                      pool=8, timeout=30)
        self.answers[w] = answer
        self.joined.wait(60)
        with Group.from_answer(answer, bind=("127.0.0.1", self.ports[w]), timeout=30) as g:
            while self.target is None or self.calls[w] < self.target:
                call = self.calls[w]
                total = g.allreduce(self.data(w, call))
                expected = sum(self.data(peer, call).astype(np.int64) for peer in range(self.workers))
                if not np.array_equal(total, expected):
                    raise AssertionError(f"worker {w} call {call}: a wrong sum")
                self.calls[w] += 1
        leave(self.controller, self.name, 0, w, answer["token"])
        return self.calls[w]

    def finish(self) -> list:
        """Every worker makes the same number of calls, then leaves. The calls are in lock step (a
        worker in call k has completed k calls, and k - 1 at least were completed by everyone), so
        one more than the most any worker completed is a number all of them reach."""
        if self.target is None:
            self.target = max(self.calls) + 1
        self.thread.join(120)
        assert all(isinstance(c, int) and c > 0 for c in self.outcome), self.outcome
        return self.outcome


# ---- one message used to end a process ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_malformed_numbers_nesting_and_framing_never_end_the_controller(services):
    endpoint, token = services["controller"], services["job"].answers[0]["token"]
    worker = WORKER()
    for cmd, field in (("join", "workers"), ("join", "worker"), ("leave", "worker"), ("alive", "worker"),
                       ("alive", "every"), ("stuck", "call"), ("stats", "job_id")):
        for value in (b"1e400", b"Infinity", b"-Infinity", b"NaN", b"1" * 5000):
            body = (b'{"version": 3, "cmd": "%s", "job": "victim", "group": 0, "worker": 0, "workers": 2, '
                    b'"token": "%s", "generation": 0, "call": 0, "host": "127.0.0.1", "udp_port": 9, '
                    b'"secret": "%s", "%s": %s}') % (cmd.encode(), token.encode(), b"ab" * 16, field.encode(), value)
            keys = ClientKeys.load(role="operator") if cmd == "stats" else worker
            reply = raw_request(endpoint, [body], keys)
            assert reply is not None and reply["ok"] is False, (cmd, field, value[:10], reply)
    reply = raw_request(endpoint, [b"[" * 60_000], worker)  # as deep as the 64 KiB limit lets it be
    assert reply is not None and ("not JSON" in reply["error"] or "nests deeper" in reply["error"]), reply
    reply = raw_request(endpoint, [b"[" * 20 + b"]" * 20], worker)
    assert reply is not None and reply["ok"] is False
    # framing: a DEALER's one frame (no delimiter), and a REQ's two frames: dropped, nobody answers
    assert raw_request(endpoint, [b'{"version": 3, "cmd": "status"}'], worker, timeout=0.5, kind=zmq.DEALER) is None
    assert raw_request(endpoint, [b"{}", b"{}"], worker, timeout=0.5) is None
    assert ask(endpoint, "status")["refused"]["malformed"] >= 2
    assert services["ctl_proc"].poll() is None


@pytest.mark.timeout(120)
def test_malformed_control_requests_never_end_the_aggregator(services):
    control = services["ps"]["control"]
    keys = ClientKeys.load(role="controller", server="aggregator")
    bodies = [b'{"version": 3, "cmd": "stats", "job": 1e400}', b'{"version": 3, "cmd": "remove_job", "job": Infinity}',
              b'{"version": 3, "cmd": "add_job", "job": {"job": 1e400, "pool": 4, "workers": ["127.0.0.1:5"]}}',
              b'{"version": 3, "cmd": "add_job", "job": {"job": 9, "pool": NaN, "workers": ["127.0.0.1:5"]}}',
              b'{"version": 3, "cmd": "add_job", "job": [1, 2]}', b"[" * 60_000, b"\xff\xfe",
              b'{"version": 3, "cmd": "add_job", "job": {"job": 9, "pool": 4, "workers": [[["x"]]]}}']
    for body in bodies:
        reply = raw_request(control, [body], keys)
        assert reply is not None and reply["ok"] is False, (body[:40], reply)
    reply = raw_request(control, [b'{"version": 3, "cmd": "ping"}', b"second"], keys)  # two frames: one answer
    assert reply is not None and "one frame" in reply["error"]
    assert ControlClient(control, keys=keys).request("ping")["ok"]  # and the socket still serves


@pytest.mark.timeout(120)
def test_stats_while_the_ps_of_a_group_is_down_answers_and_the_controller_lives(services):
    services["job"].finish()
    held = join(services["controller"], "held", 0, 1, host="127.0.0.1", udp_port=free_udp_ports(1)[0], timeout=30)
    services["ps_proc"].kill()  # the group "held" is allocated on it
    services["ps_proc"].wait(10)
    services["must_live"].remove(services["ps_proc"])
    out = subprocess.run([str(BIN / "passing-ctl"), "--controller", services["controller"], "stats"],
                         capture_output=True, text=True, timeout=60)
    assert services["ctl_proc"].poll() is None, "stats ended the controller"
    assert out.returncode == 0, out.stderr
    assert "did not answer" in json.loads(out.stdout)[str(held["job_id"])]["error"]
    assert ask(services["controller"], "status")["ok"]


# ---- nobody acts on a job that is not theirs -----------------------------------------------------


@pytest.mark.timeout(120)
def test_a_worker_cannot_end_see_or_join_another_job(services):
    endpoint, job = services["controller"], services["job"]
    with pytest.raises(ControllerError, match="for operators"):  # a leave without a worker: the whole group
        request(endpoint, "leave", job="victim", group=0)
    with pytest.raises(ControllerError, match="for operators"):  # status would list pending groups by name
        request(endpoint, "status")
    with pytest.raises(ControllerError, match="no worker 1 with this token"):
        leave(endpoint, "victim", 0, 1, "12" * 16)
    # a pending group: its missing worker's place cannot be taken without the job's secret
    ports = free_udp_ports(2)
    def first_worker() -> None:  # waits for a second worker that never comes
        with pytest.raises(ControllerError, match="did not answer"):
            join(endpoint, "pending", 0, 2, host="127.0.0.1", udp_port=ports[0], secret="aa" * 16, timeout=3)

    first = threading.Thread(target=first_worker)
    first.start()
    time.sleep(0.3)
    with pytest.raises(ControllerError, match="wrong job secret"):
        join(endpoint, "pending", 1, 2, host="127.0.0.1", udp_port=ports[1], secret="bb" * 16, timeout=5)
    first.join()
    assert services["ctl_proc"].poll() is None
    assert job.calls[0] > 0


@pytest.mark.timeout(120)
def test_forged_heartbeats_and_stuck_reports_change_nothing(services):
    endpoint, job = services["controller"], services["job"]
    generation, job_id = job.answers[0]["generation"], job.answers[0]["job_id"]
    for cmd in ("stuck", "alive", "report"):
        with pytest.raises(ControllerError, match="token"):
            request(endpoint, cmd, job="victim", group=0, worker=1, job_id=job_id, generation=generation, call=0,
                    every=1.0, stats={}, token="34" * 16)
        with pytest.raises(ControllerError, match="missing field 'token'"):
            request(endpoint, cmd, job="victim", group=0, worker=1, job_id=job_id, generation=generation, call=0,
                    every=1.0, stats={})
    # made-up groups leave no state behind: 2 000 heartbeats, then the controller's memory is what it was
    # (one connection for them all: a CURVE handshake per request would be most of the test's time)
    before = rss_kib(services["ctl_proc"].pid)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        ClientKeys.load(role="worker").apply(sock)
        sock.connect(endpoint)
        for i in range(2000):
            sock.send_json({"version": rpc.CONTROLLER_VERSION, "cmd": "alive", "job": f"made-up-{i}", "group": 0,
                            "worker": 0, "token": "56" * 16, "every": 1.0})
            assert sock.poll(10_000), f"heartbeat {i} unanswered"
            reply = sock.recv_json()
            assert not reply["ok"] and "not running" in reply["error"], reply
    finally:
        sock.close()
    assert rss_kib(services["ctl_proc"].pid) - before < 8 * 1024
    status = ask(endpoint, "status")
    assert [j["job"] for j in status["jobs"]] == ["victim"]  # still there, not moved
    calls = list(job.calls)
    time.sleep(0.5)
    assert all(now > then for now, then in zip(job.calls, calls, strict=True)), "the job stopped"


@pytest.mark.timeout(120)
def test_only_the_controller_key_reaches_an_aggregator(services):
    control = services["ps"]["control"]
    victim = services["job"].answers[0]["job_id"]
    others = [ClientKeys.load(role=role, server="aggregator") for role in ("worker", "operator")]

    def attempt(i: int) -> object:  # each waits out its 1 s for an answer that never comes: the three at once
        if i == len(others):
            return raw_request(control, [b'{"version": 3, "cmd": "remove_job", "job": 1}'], None, timeout=1.0)
        return ControlClient(control, timeout=1.0, keys=others[i]).request("remove_job", job=victim)

    outcomes = run_threads(attempt, len(others) + 1)
    assert all(isinstance(o, TimeoutError) for o in outcomes[:-1]), outcomes  # CURVE refuses the handshake
    assert outcomes[-1] is None  # and without a key: no answer at all
    jobs = ControlClient(control).request("jobs")["jobs"]
    assert [j["job"] for j in jobs] == [victim]  # untouched


@pytest.mark.timeout(120)
def test_no_key_no_answer_and_an_oversized_message_is_dropped(services):
    endpoint = services["controller"]
    stranger = ClientKeys(ClientKeys.load().server, *zmq.curve_keypair())
    unanswered = [(b'{"version": 3, "cmd": "status"}', None), (b'{"version": 3, "cmd": "join"}', stranger)]
    # no key, a stranger's key: each request waits out its 1 s for no answer, the two at once
    assert run_threads(lambda i: raw_request(endpoint, [unanswered[i][0]], unanswered[i][1], timeout=1.0),
                       len(unanswered)) == [None, None]
    before = rss_kib(services["ctl_proc"].pid)
    # 256 MiB once took ~830 MB and 9 s: now each connection is dropped unread. Four at once (each
    # request waits out its 1 s for the answer that never comes): 256 MiB in flight together.
    oversized = b" " * (64 << 20)
    assert run_threads(lambda _: raw_request(endpoint, [oversized], WORKER(), timeout=1.0), 4) == [None] * 4
    assert rss_kib(services["ctl_proc"].pid) - before < 32 * 1024
    assert ask(endpoint, "status")["ok"]


def test_a_bad_pool_is_refused_to_every_joiner_at_once(services):
    endpoint = services["controller"]
    for pool in (0, -1, 1 << 40):
        began = time.monotonic()
        with pytest.raises(ControllerError, match="pool"):
            join(endpoint, "bad-pool", 0, 2, host="127.0.0.1", udp_port=9999, pool=pool, timeout=10)
        assert time.monotonic() - began < 5  # an answer now, not at the join timeout


def test_the_services_listen_on_loopback_by_default():
    out = subprocess.run([str(BIN / "passing-controller"), "--help"], capture_output=True, text=True, timeout=30)
    assert "tcp://127.0.0.1:9090" in out.stdout.replace("\n", " ")
    out = subprocess.run([str(BIN / "passing-aggregator"), "serve", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert "127.0.0.1:9877" in out.stdout and "tcp://127.0.0.1:9878" in out.stdout


def test_missing_or_exposed_keys_are_clear_errors(tmp_path):
    env = {**os.environ, "PASSING_KEYS": str(tmp_path / "nowhere")}
    out = subprocess.run([str(BIN / "passing-controller"), "--topology", "/dev/null"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "passing-ctl keygen" in out.stderr
    out = subprocess.run([str(BIN / "passing-ctl"), "--keys", str(tmp_path / "k"), "keygen"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "k" / "worker.key_secret").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    again = subprocess.run([str(BIN / "passing-ctl"), "--keys", str(tmp_path / "k"), "keygen"], capture_output=True,
                           text=True, timeout=30)
    assert again.returncode == 1 and "--force" in again.stderr
    os.chmod(tmp_path / "k" / "operator.key_secret", 0o644)
    out = subprocess.run([str(BIN / "passing-ctl"), "--keys", str(tmp_path / "k"), "status"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "readable by others" in out.stderr
    with pytest.raises(KeysError, match="readable by others"):
        ClientKeys.load(tmp_path / "k", role="operator")


# ---- the campaign: 100 000 random and mutated messages at both endpoints while a job runs ---------

NASTY = ["1e400", "Infinity", "-Infinity", "NaN", "-1", "0", str(1 << 63), str(1 << 64), "1.5", "true", "null",
         '""', '"' + "x" * 300 + '"', "[]", "{}", "[" * 8 + "]" * 8, '{"a": {"b": {"c": [1]}}}', '"\\u0000"',
         '"' + "ab" * 16 + '"', "-0", "1" * 400, '"victim"', '"127.0.0.1"', '"tcp://127.0.0.1:1"']


def controller_templates(token: str) -> list[dict]:
    """Requests about the running job with a token that is not its worker's (the attacker's guess), and
    joins of a group of 3 that no mutation can complete (worker 1 is never among the values)."""
    base = {"version": 3, "job": "victim", "group": 0, "worker": 1}
    return [
        {**base, "cmd": "join", "job": "campaign", "worker": 2, "workers": 3, "host": "127.0.0.1", "udp_port": 9,
         "secret": "ab" * 16},
        {**base, "cmd": "leave", "token": token}, {**base, "cmd": "alive", "token": token, "every": 1.0},
        {**base, "cmd": "stuck", "token": token, "job_id": 1, "generation": 0, "call": 3},
        {**base, "cmd": "report", "token": token, "stats": {"calls": 1, "packets_sent": 3}},
        {"version": 3, "cmd": "status"}, {"version": 3, "cmd": "metrics"}, {"version": 3, "cmd": "stats", "job_id": 1},
    ]


def aggregator_templates(victim: int) -> list[dict]:
    other = victim + 100  # never the victim's job id: the controller's key may remove any job, by design
    return [
        {"version": 3, "cmd": "add_job", "job": {"job": other, "base": 3000, "pool": 4, "workers": ["127.0.0.1:7"]}},
        {"version": 3, "cmd": "remove_job", "job": other}, {"version": 3, "cmd": "stats", "job": other},
        {"version": 3, "cmd": "ping"}, {"version": 3, "cmd": "jobs"},
    ]


def mutate(rng: np.random.Generator, template: dict) -> bytes:
    """One hostile message made from a valid one."""
    msg = json.loads(json.dumps(template))
    target = msg["job"] if isinstance(msg.get("job"), dict) and rng.random() < 0.5 else msg
    kind = rng.integers(6)
    keys = list(target)
    placeholder = None
    if kind == 0 and keys:  # a field gets a nasty value
        placeholder = NASTY[rng.integers(len(NASTY))]
        target[keys[rng.integers(len(keys))]] = "\x00PLACEHOLDER"
    elif kind == 1 and keys:
        del target[keys[rng.integers(len(keys))]]
    elif kind == 2:
        placeholder = NASTY[rng.integers(len(NASTY))]
        target[f"k{rng.integers(100)}"] = "\x00PLACEHOLDER"
    raw = json.dumps(msg).encode()
    if placeholder is not None:
        raw = raw.replace(b'"\\u0000PLACEHOLDER"', placeholder.encode())
    if kind == 3:  # flipped bytes
        raw = bytearray(raw)
        for at in rng.integers(0, len(raw), rng.integers(1, 4)):
            raw[at] = rng.integers(256)
        raw = bytes(raw)
    elif kind == 4:
        raw = raw[: rng.integers(len(raw))]
    elif kind == 5:
        raw = rng.bytes(int(rng.integers(1, 200)))
    return raw


def blast(endpoint: str, keys: ClientKeys, messages: list[bytes], window: int = 500) -> int:
    """Every message as a request on one DEALER socket, ``window`` in flight; returns the replies."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    keys.apply(sock)
    sock.connect(endpoint)
    replies = sent = 0
    try:
        while replies < len(messages):
            while sent < len(messages) and sent - replies < window:
                sock.send_multipart([b"", messages[sent]])
                sent += 1
            if not sock.poll(20_000):
                raise AssertionError(f"{endpoint} stopped answering after {replies} replies")
            parts = sock.recv_multipart()
            assert json.loads(parts[-1])["ok"] in (True, False)
            replies += 1
    finally:
        sock.close()
    return replies


@pytest.mark.slow  # the campaign: `make test-all` runs it
@pytest.mark.timeout(600)
def test_campaign_of_100000_hostile_messages_while_a_job_runs(services):
    job, rng = services["job"], np.random.default_rng(21)
    guess = "cd" * 16
    assert guess not in {a["token"] for a in job.answers.values()}
    victim = job.answers[0]["job_id"]
    to_controller = [mutate(rng, controller_templates(guess)[rng.integers(8)]) for _ in range(60_000)]
    to_aggregator = [mutate(rng, aggregator_templates(victim)[rng.integers(5)]) for _ in range(40_000)]
    ctl_pid, ps_pid = services["ctl_proc"].pid, services["ps_proc"].pid
    rss_before = rss_kib(ctl_pid), rss_kib(ps_pid)
    calls_before = sum(job.calls)
    began = time.monotonic()
    answered = run_threads(lambda i: blast(services["controller"], WORKER(), to_controller) if i == 0 else
                           blast(services["ps"]["control"], ClientKeys.load(role="controller", server="aggregator"),
                                 to_aggregator), 2, timeout=500)
    seconds = time.monotonic() - began
    assert answered == [60_000, 40_000], answered
    rss_after = rss_kib(ctl_pid), rss_kib(ps_pid)
    calls = job.finish()
    status = ask(services["controller"], "status")
    print(f"\ncampaign: {len(to_controller)} messages at the controller, {len(to_aggregator)} at the aggregator, "
          f"every one answered, in {seconds:.1f} s; refused by the controller {status['refused']}; RSS "
          f"controller {rss_before[0] / 1024:.0f} -> {rss_after[0] / 1024:.0f} MiB, aggregator "
          f"{rss_before[1] / 1024:.0f} -> {rss_after[1] / 1024:.0f} MiB; the victim job completed "
          f"{sum(calls) - calls_before} checked calls meanwhile")
    print(f"the aggregator refused {ControlClient(services['ps']['control']).request('ping')['control']}")
    assert services["ctl_proc"].poll() is None and services["ps_proc"].poll() is None
    assert rss_after[0] - rss_before[0] < 64 * 1024 and rss_after[1] - rss_before[1] < 64 * 1024
    assert sum(calls) > calls_before  # the job went on, every sum exact (checked by its workers)
    assert [j["job"] for j in status["jobs"]] == []  # the victim left cleanly, nothing else was admitted
    assert status["refused"]["internal"] == 0  # every hostile message met a check, not a bug
    ping = ControlClient(services["ps"]["control"]).request("ping")["control"]
    assert ping["internal_errors"] == 0 and ping["refused"] > 30_000
