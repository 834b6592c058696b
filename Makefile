# PASSING: one Makefile for setup, tests, demo and benchmarks.
# PYTHON makes the venv and runs the scripts that need the standard library alone (p4/testgen_vectors.py,
# p4/tna/resources.py: they run where the P4 tools are and PASSING need not be); whatever runs the project's
# code is the venv's $(PY), after $(STAMP) (tests/test_make_targets.py holds every documented target to that).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all setup test test-all test-torch-suite lint demo bench bench-quick bench-racks bench-core bench-control bench-bmv2 p4 p4-tofino p4-tofino2 p4-testgen p4-mutants clean

all: test

# host/csrc is compiled by the install (host/setup.py): a change there reinstalls.
# The install is uv's (from PyPI, into the venv): the same packages as pip's, in ~10 s where pip takes
# ~90 s (pip unzips torch and byte-compiles every file on one thread). uv compiles nothing: the modules a
# run imports are compiled as they are first imported and cached, which PYTHONDONTWRITEBYTECODE (set on
# some machines, this one among them) would forbid, making every process that imports torch compile it
# again (5.5 s instead of 2.6 s): so no recipe here inherits it. uv reads no pip configuration, so it is
# given pip's find-links (where a machine keeps wheels such as its CPU torch: without them torch==2.13.0 is
# PyPI's, as for pip).
unexport PYTHONDONTWRITEBYTECODE
PIP_FIND_LINKS_ARGS = $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/.*find-links='\([^']*\)'/\1/p" \
                        | tr ' ' '\n' | sort -u | sed 's/^/--find-links /')
INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) $(PIP_FIND_LINKS_ARGS)
$(STAMP): protocol/pyproject.toml host/pyproject.toml host/setup.py host/xdp_build.py controller/pyproject.toml $(wildcard host/csrc/*.c host/csrc/*.h host/csrc/bpf/*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv
	$(INSTALL) -e protocol -e 'host[test]' -e 'controller[test,switch]'
	touch $(STAMP)

setup: $(STAMP)

# Runs everything that needs no BMv2 but the tests marked `slow` (soaks, campaigns: it says how
# many it left out); BMv2/Mininet tests skip with a reason when absent. test-all runs every test,
# slow ones included: CI does (.ci/run).
# pytest's exit 5 ("no tests collected") is a failure here, never a pass.
# TEST_WORKERS: pytest-xdist processes (loadgroup: a module's tests stay together, the BMv2 suite is one
# group; conftest.py). Much of the suite waits (timeouts a scenario is about, process start-up): with two
# workers the two cores are busy 1.7 of the time, with one under 1. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup
test: $(STAMP)
	$(PY) -m ruff check protocol host controller tests bench bmv2_tests demo cluster p4
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PY) -m ruff check protocol host controller tests bench bmv2_tests demo cluster p4
	$(PYTEST)

# PyTorch's own distributed suite on "passing" (2 servers x 2 ranks, nothing configured and
# PASSING_EMBEDDED=ps) against gloo's outcomes in the same run (tests/test_torch_suite.py; slow, so CI's).
test-torch-suite: $(STAMP)
	$(PY) -m pytest -p no:xdist -s tests/test_torch_suite.py

lint: $(STAMP)
	$(PY) -m ruff check protocol host controller tests bench bmv2_tests demo cluster p4

# The main job: a multi-host run on BMv2 in Mininet when BMv2, p4c and Mininet are here
# (as root), else on the software aggregator with worker processes on loopback; it says which.
# DEMO=tree: on BMv2, a tree across two racks with the switch as one rack's leaf (needs BMv2).
demo: $(STAMP)
	$(PY) demo/run.py $(if $(DEMO),--$(DEMO))

# The emulated-cluster comparison of the schemes of docs/torch.md ("Schemes") (root: network namespaces;
# docs/benchmarks.md). bench-quick: under 10 minutes; bench: every configuration. SWITCH_KIND: the switch the
# emulated one stands for, tofino (64 lanes, the default) or tofino2 (72): a software aggregator at that lane count.
SWITCH_KIND ?= tofino
bench: $(STAMP)
	$(INSTALL) -e protocol -e 'host[bench]'
	$(PY) bench/emulated.py --switch-kind $(SWITCH_KIND)

bench-quick: $(STAMP)
	$(INSTALL) -e protocol -e 'host[bench]'
	$(PY) bench/emulated.py --quick --switch-kind $(SWITCH_KIND)

# Racks (issue 47): 4 racks x 2 servers under leaves and a spine, uplinks 1:1, 2:1 and 4:1; rack-ordered ring,
# hierarchical ring, PS and the PASSING tree beside the cost model; then 32 servers, small tensors: the ring's
# 2(N - 1) steps against the tree's round trip (root: network namespaces; docs/benchmarks.md, Racks).
bench-racks: $(STAMP)
	$(INSTALL) -e protocol -e 'host[bench]'
	$(PY) bench/emulated_racks.py

bench-core: $(STAMP)
	$(INSTALL) -e protocol -e 'host[torch]'
	$(PY) bench/core.py

# The controller under load: 256 jobs x 8 workers heartbeating, 50 joins/leaves per second, a failover
# (bench/control_load.py; docs/benchmarks.md).
bench-control: $(STAMP)
	$(PY) bench/control_load.py

# BMv2 forwarding vs aggregation rates in Mininet (root, BMv2, p4c, Mininet: docs/bmv2.md).
bench-bmv2: $(STAMP)
	$(PY) bench/bmv2.py

# The BMv2 program: BMv2 JSON + P4Info in build/v1model/. Needs p4c (docs/bmv2.md).
P4_SOURCES := $(wildcard p4/include/*.p4) p4/v1model/passing.p4
p4: build/v1model/passing.json

build/v1model/passing.json: $(P4_SOURCES)
	@command -v p4c-bm2-ss >/dev/null || { echo "make p4: p4c-bm2-ss not found; install p4c from upstream (docs/bmv2.md)" >&2; exit 1; }
	mkdir -p build/v1model
	p4c-bm2-ss --arch v1model --std p4-16 --p4runtime-files build/v1model/passing.p4info.txtpb \
		-o build/v1model/passing.json p4/v1model/passing.p4

# The Tofino 1 program: build/tofino/ (pipe/tofino.bin, pipe/context.json, bfrt.json,
# P4Info, passing.conf for bf_switchd / Stratum, logs) and its resource summary. Needs p4c
# built with its Tofino backend (docs/tofino.md): p4c-barefoot compiles, bfas assembles
# and fails when the program does not fit the chip (e.g. more than 12 stages).
# TOFINO_LANES: int32 values per packet (the wire's lanes; the controller's topology
# "lanes" must match). TOFINO_OUT: where to put it.
TOFINO_LANES ?= 64
TOFINO_OUT ?= build/tofino
TNA_SOURCES := $(wildcard p4/include/*.p4) p4/tna/passing.p4
# One build for both Tofino chips: $(1) the make target, $(2) the chip (tofino, tofino2), $(3) its
# architecture, $(4) the program, $(5) the output directory, $(6) its lanes.
define tofino_build
@for tool in p4c-barefoot bfas p4c-gen-conf; do command -v $$tool >/dev/null || { echo "make $(1): $$tool not found; build p4c with -DENABLE_TOFINO=ON (docs/tofino.md)" >&2; exit 1; }; done
rm -rf $(5) && mkdir -p $(5)
p4c-barefoot --target $(2) --arch $(3) --std p4-16 -g --verbose -Ttable_summary:1 -DPASSING_LANES=$(6) \
	--p4runtime-force-std-externs \
	--p4runtime-files $(5)/passing.p4info.txtpb --bf-rt-schema $(5)/bfrt.json \
	-o $(5) $(4)
bfas --target $(2) --table-handle-offset0 -o $(5)/pipe $(5)/pipe/passing.bfa
p4c-gen-conf --conf-type BF-RT --device $(2) --name passing --p4-version p4-16 --pipe pipe \
	--outputdir $(5) --bfrt-name $(5)/bfrt.json
$(PYTHON) p4/tna/resources.py $(5)
endef
p4-tofino: $(TNA_SOURCES)
	$(call tofino_build,p4-tofino,tofino,tna,p4/tna/passing.p4,$(TOFINO_OUT),$(TOFINO_LANES))

# The Tofino 2 program (p4/t2na/passing.p4): build/tofino2/, as p4-tofino does for Tofino 1
# (pipe/tofino2.bin, context.json, bfrt.json, P4Info, passing.conf) and its resource
# summary; bfas fails when it does not fit (more than 20 stages). TOFINO2_LANES: int32
# values per packet, by default the program's PASSING_T2NA_LANES (the one place it is
# written). TOFINO2_OUT: where to put it.
TOFINO2_LANES ?= $(shell sed -n 's/^\#define PASSING_T2NA_LANES \([0-9][0-9]*\).*/\1/p' p4/t2na/passing.p4)
TOFINO2_OUT ?= build/tofino2
T2NA_SOURCES := $(wildcard p4/include/*.p4) p4/t2na/passing.p4
p4-tofino2: $(T2NA_SOURCES)
	$(call tofino_build,p4-tofino2,tofino2,t2na,p4/t2na/passing.p4,$(TOFINO2_OUT),$(TOFINO2_LANES))

# P4Testgen's tests of the three programs as vectors beside them (p4/tna/testgen.json, p4/t2na/testgen.json,
# p4/v1model/testgen.json, the v1model program's tree sequences at 4 lanes, p4/v1model/testgen_tree.json, and the
# Tofino 2 program's at its vectors' lanes, p4/t2na/testgen_tree.json;
# the Tofino 2 program needs P4Testgen with the patch docs/tofino.md describes;
# docs/tofino.md, "Executed by P4Testgen"); tests/test_testgen_vectors.py holds them against the protocol and
# fails when they are stale, bmv2_tests/test_testgen_replay_bmv2.py replays the v1model ones on BMv2. Needs
# p4testgen built from upstream p4c with its tofino and bmv2 targets; P4C_SOURCE: that p4c checkout (for
# tna.p4), /opt/src/p4c by default. Paths explored per run (of the TNA program's only those that cover a new
# statement are kept), and the seeds (those of the vectors in the repository: seed 1 left the TNA program's
# first pass at 497 statements, seed 2 reached 631).
TESTGEN_MAX_TESTS ?= 600
TESTGEN_SEED ?= 2
# the Tofino 2 program's: at 8 lanes (its lane pairs are one macro unrolled; the greedy run at the program's lanes
# did not end in 36 minutes of CPU here: docs/tofino.md), 100 paths
TESTGEN_T2NA_LANES ?= 8
TESTGEN_T2NA_MAX_TESTS ?= 100
TESTGEN_V1MODEL_MAX_TESTS ?= 300
TESTGEN_V1MODEL_SEED ?= 3
p4-testgen:
	@command -v p4testgen >/dev/null || { echo "make p4-testgen: p4testgen not found; build p4c with its test tools (docs/tofino.md)" >&2; exit 1; }
	$(PYTHON) p4/testgen_vectors.py generate tna --max-tests $(TESTGEN_MAX_TESTS) --seed $(TESTGEN_SEED)
	$(PYTHON) p4/testgen_vectors.py generate t2na --lanes $(TESTGEN_T2NA_LANES) --max-tests $(TESTGEN_T2NA_MAX_TESTS) --seed $(TESTGEN_SEED)
	$(PYTHON) p4/testgen_vectors.py generate t2na_tree --lanes $(TESTGEN_T2NA_LANES)
	$(PYTHON) p4/testgen_vectors.py generate v1model --max-tests $(TESTGEN_V1MODEL_MAX_TESTS) --seed $(TESTGEN_V1MODEL_SEED)
	$(PYTHON) p4/testgen_vectors.py generate v1model_tree --lanes 4

# The mutation score of the vector checks (docs/tofino.md, "Mutation score"): bugs planted one at a time in the
# reference engine (the vectors in the repository checked against each; seconds, no P4 tool) and, with
# P4MUTANTS=1, in the TNA program (P4Testgen makes each mutant's vectors at 4 lanes, minutes each; results
# recorded in p4/tna/mutants.json) and in the tree rules of the v1model and Tofino 2 programs (their tree
# sequences made again on each; p4/v1model/tree_mutants.json, p4/t2na/tree_mutants.json). Fails below 90 % killed. It runs the project's code: the venv's Python.
p4-mutants: $(STAMP)
	$(PY) -m tests.conformance.mutants $(if $(P4MUTANTS),--p4 --record p4/tna/mutants.json)
	$(if $(P4MUTANTS),$(PY) -m tests.conformance.tree_mutants --record p4/v1model/tree_mutants.json)
	$(if $(P4MUTANTS),$(PY) -m tests.conformance.tree_mutants --program t2na --record p4/t2na/tree_mutants.json)

clean:
	rm -rf $(VENV) build .pytest_cache

# ---- the native library (host/csrc) under sanitizers and a fuzzer -----------------------
# sanitize: the library built with AddressSanitizer + UBSan (gcc) into build/native-asan/, and
# the native differential, scenario, edge-case, non-finite, turnover, UDP data-path, psn-wrap, lanes and
# sharded-collectives (relays, ACKs), in-host bulk-move, two-level tree and AF_XDP-path tests (the library is
# built with the AF_XDP path where host/xdp_build.py can build it, as the install does)
# (both engines:
# the aggregator's and the host's) run against it; any report fails the run
# (--capture=sys: a report written to fd 2 by a dying process is not swallowed).
# fuzz: the libFuzzer harnesses of the aggregation engine and of the AF_XDP path's frame parser
# (clang) for FUZZ_SECONDS each; their corpora are kept in build/fuzz/corpus and build/fuzz/frame-corpus. Needs clang and compiler-rt: apt-get install clang-14
# libclang-rt-14-dev (Debian bookworm).
NATIVE_SOURCES := $(filter-out host/csrc/fuzz_%.c,$(wildcard host/csrc/*.c))
NATIVE_ASAN    := build/native-asan/libpassing_native.so
SANITIZE_FLAGS := -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all \
                  -Wall -Wextra -Werror -fPIC -pthread -Ihost/csrc
CLANG          ?= $(shell command -v clang-14 || command -v clang)
FUZZ_SECONDS   ?= 60

.PHONY: sanitize fuzz

sanitize: $(STAMP)
	mkdir -p build/native-asan
	gcc $(SANITIZE_FLAGS) -shared -o $(NATIVE_ASAN) $(NATIVE_SOURCES) $$($(PYTHON) host/xdp_build.py build/native-asan/xdp)
	PASSING_NATIVE_LIB=$(CURDIR)/$(NATIVE_ASAN) \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		$(PY) -m pytest -q -p no:cacheprovider --capture=sys tests/test_native_engine.py tests/test_scenarios.py \
		tests/test_edge_cases.py tests/test_nonfinite.py tests/test_generation.py tests/test_datapath.py \
		tests/test_psn_wrap.py tests/test_lanes.py tests/test_sharded_collectives.py tests/test_in_host.py \
		tests/test_tree.py tests/test_xdp.py

fuzz:
	@test -n "$(CLANG)" || { echo "make fuzz: clang not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }
	mkdir -p build/fuzz/corpus
	$(CLANG) -std=c11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror \
		-pthread -Ihost/csrc -o build/fuzz/fuzz_engine host/csrc/fuzz_engine.c host/csrc/engine.c host/csrc/engine_jobs.c host/csrc/wire.c
	build/fuzz/fuzz_engine -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 build/fuzz/corpus
	mkdir -p build/fuzz/frame-corpus
	$(CLANG) -std=c11 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror \
		-Ihost/csrc -o build/fuzz/fuzz_frame host/csrc/fuzz_frame.c host/csrc/frame.c
	build/fuzz/fuzz_frame -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 build/fuzz/frame-corpus

# ---- the differential fuzzer of backend "passing" against gloo (tests/differential) --------------
# Random programs of torch.distributed collectives on gloo and on passing, compared by machine; `make test`
# runs a fixed share of them (tests/test_torch_differential.py). SEED: the first program's seed (default
# random, printed); MODE: ring, embedded, ps or all; LAYOUT: servers x ranks per server; PROGRAMS: programs
# per launch; DURATION: a soak, new seeds until that many seconds passed; FAULTS: fault launches to run
# too; FAULT: replay one (raise|skip|kill:RANK:OP, aggregator:kill|stop:OP), as a divergence prints it.
MODE     ?= all
LAYOUT   ?= 2x2
PROGRAMS ?= 1
DURATION ?= 0
FAULTS   ?= 0
.PHONY: fuzz-torch
fuzz-torch: $(STAMP)
	$(PY) -m tests.differential.oracle $(if $(SEED),--seed $(SEED)) --mode $(MODE) --layout $(LAYOUT) \
		--programs $(PROGRAMS) --duration $(DURATION) --faults $(FAULTS) $(if $(FAULT),--fault $(FAULT))
