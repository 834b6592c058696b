"""Backend "passing" against gloo, by machine (the design guide: "gloo is the oracle"): random
programs of torch.distributed collectives (tests/differential/program.py), run by real rank
processes (2 servers x 2 ranks, and 2 x 1, 3 x 1) on gloo and on passing in each mode (nothing
configured: "ring"; PASSING_EMBEDDED=ps: "embedded"; an external controller and software
aggregator: "ps"), compared by tests/differential/oracle.py (its docstring says what must agree).

`make test` runs FUZZ_PROGRAMS (20) programs per mode at 2 x 2, in one launch per mode against one gloo
launch. The slow part (CI) runs 8 more at 2 x 1 and at 3 x 1 (there, with an aggregator,
PASSING_KEEP_ON_GLOO=all_gather) the same way (a launch's start, not its programs, is most of its time),
FUZZ_SLOW_PROGRAMS (160) more per mode at 2 x 2 and 24 at each small layout (208 in all), and 12
faults (a rank that raises, skips a call or is SIGKILLed at some op; the aggregator SIGKILLed or
SIGSTOPped), each on gloo and on every mode that has it: 30 fault launches of passing.

FUZZ_SEED sets the seed base (fixed by default, so CI is reproducible); a failure prints each
diverging program, a replay command (`make fuzz-torch SEED=... MODE=...`) and, within
FUZZ_SHRINK_SECONDS, a smaller program that still diverges; FUZZ_REPORT names a file that gets
every divergence as a JSON line.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")

from tests.differential import oracle  # noqa: E402
from tests.differential.program import Layout, format  # noqa: E402

SEED = int(os.environ.get("FUZZ_SEED", "7100"))
PROGRAMS = int(os.environ.get("FUZZ_PROGRAMS", "20"))
SLOW_PROGRAMS = int(os.environ.get("FUZZ_SLOW_PROGRAMS", "160"))
SHRINK = float(os.environ.get("FUZZ_SHRINK_SECONDS", "15"))
REPORT = os.environ.get("FUZZ_REPORT", "")  # a file each divergence is appended to, as a JSON line
FAULTS = 12  # 9 rank faults x 3 modes + 3 aggregator faults (mode ps) = 30 fault launches of passing

QUICK: dict[Layout, list[int]] = {(2, 2): list(range(SEED, SEED + PROGRAMS)),
                                  (2, 1): list(range(SEED + 1000, SEED + 1008)),
                                  (3, 1): list(range(SEED + 2000, SEED + 2008))}
SLOW_LAUNCH = 40  # programs per launch in the slow part: a launch that goes wrong loses no more
SLOW: dict[Layout, list[list[int]]] = {
    (2, 2): [list(range(s, min(s + SLOW_LAUNCH, SEED + 10_000 + SLOW_PROGRAMS)))
             for s in range(SEED + 10_000, SEED + 10_000 + SLOW_PROGRAMS, SLOW_LAUNCH)],
    (2, 1): [list(range(SEED + 11_000, SEED + 11_024))],
    (3, 1): [list(range(SEED + 12_000, SEED + 12_024))],
}


def settings(mode: str, layout: Layout) -> dict[str, str]:
    """3 x 1 with an aggregator keeps all_gather on gloo (PASSING_KEEP_ON_GLOO): the same answers, and no
    gather lane set up."""
    return {"PASSING_KEEP_ON_GLOO": "all_gather"} if layout == (3, 1) and mode in ("embedded", "ps") else {}


@pytest.fixture(scope="module")
def gloo():
    """The gloo launch of a list of seeds at a layout, run once for every mode of the module."""
    launches: dict[tuple[Layout, tuple[int, ...]], oracle.Launch] = {}

    def reference(layout: Layout, seeds: list[int]) -> oracle.Launch:
        key = (layout, tuple(seeds))
        if key not in launches:
            launch = oracle.run_launch("gloo", seeds, layout)
            problems = oracle.check_reference(launch)
            assert not problems, "the gloo reference itself is wrong (the fuzzer's fault):\n" + "\n".join(problems)
            print(f"gloo {layout[0]}x{layout[1]}: {len(seeds)} programs in {launch.seconds:.1f} s")
            launches[key] = launch
        return launches[key]

    return reference


# Divergences the fuzzer found that are not fixed yet (docs/torch.md, "The differential fuzzer": open): one that
# recurs is printed and fails nothing; every other divergence fails the test. Remove an entry with its fix.
OPEN: dict[str, str] = {}


def open_divergence(d: oracle.Divergence) -> str | None:
    """The OPEN entry ``d`` is, if any (a key of OPEN found in its line)."""
    return next((why for key, why in OPEN.items() if key in d.line()), None)


def check(reference: oracle.Launch, candidate: oracle.Launch, shrink: float) -> list[str]:
    """The candidate's divergences as a report (empty: none); the first one shrunk within ``shrink`` s. Open
    ones (OPEN) are printed, not returned."""
    found = oracle.compare(reference, candidate)
    for d in [d for d in found if open_divergence(d)]:
        print(f"open ({open_divergence(d)}): {d.line()}")
    found = [d for d in found if not open_divergence(d)]
    print(f"{candidate.mode} {candidate.layout[0]}x{candidate.layout[1]}: {len(candidate.programs)} programs in "
          f"{candidate.seconds:.1f} s, {len(found)} divergences, {len(set(candidate.notes))} notes")
    if not found:
        return []
    if REPORT:
        oracle.record_json(found, REPORT)
    text = [oracle.report(found)]
    first = min((d for d in found if d.op is not None), key=lambda d: (d.seed, d.op), default=None)
    if first is not None and shrink > 0:
        small = oracle.shrink(reference, first, shrink)
        if small is not None:
            text.append(f"shrunk within {shrink:.0f} s ({first.what} at op {first.op}):\n{format(small)}")
    return text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [layout if layout == (2, 2) else pytest.param(layout, marks=pytest.mark.slow)
                                    for layout in QUICK], ids=lambda layout: f"{layout[0]}x{layout[1]}")
@pytest.mark.parametrize("mode", oracle.MODES)
def test_random_programs_run_as_on_gloo(mode, layout, gloo):
    seeds = QUICK[layout]
    reference = gloo(layout, seeds)
    failures = check(reference, oracle.run_launch(mode, seeds, layout, env=settings(mode, layout)), SHRINK)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", oracle.MODES)
def test_many_random_programs_run_as_on_gloo(mode, gloo):
    failures = []
    for layout, launches in SLOW.items():
        for seeds in launches:
            failures += check(gloo(layout, seeds), oracle.run_launch(mode, seeds, layout, env=settings(mode, layout)),
                              SHRINK if not failures else 0)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_faults_end_as_on_gloo():
    """A rank that raises, skips a call (and issues nothing more) or is SIGKILLed, the aggregator killed or
    stopped: every other rank completes with gloo's values or raises, within the bound, and the ranks
    that raise are those that raise on gloo (oracle.compare_fault)."""
    found, launched = oracle.faults_campaign(SEED + 20_000, FAULTS, (2, 2))
    assert launched >= 30
    if REPORT and found:
        oracle.record_json(found, REPORT, plain=True)
    assert not found, oracle.report(found, plain=True)


# Fault launches the fuzzer found diverging, kept as regressions: (fault, seed) as `make fuzz-torch FAULT=... SEED=...`
FOUND_FAULTS = [("skip:1:3", 3100369)]  # a subgroup's gather skipped by rank 1: hung past the bound (embedded:
#                                         the others' destroy waited for rank 0; and the fuzzer's subgroups had
#                                         torch's 30-minute default timeout, on gloo too)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,seed", FOUND_FAULTS, ids=lambda v: str(v))
def test_faults_the_fuzzer_found_end_as_on_gloo(fault, seed):
    assert oracle.replay_fault(oracle.parse_fault(fault, seed), (2, 2), oracle.MODES) == 0
