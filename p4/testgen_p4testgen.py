"""One P4Testgen run of a program (p4/testgen_vectors.py) and its PTF output as vectors: table entries,
initial registers, the input and expected output, and from the path's trace what the ingress deparser emitted
and what each RegisterAction wrote back. Standard library only."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testgen_programs import P4C_SOURCE, ROOT, TARGET_DEFINES, TARGET_INCLUDES, Program, Run


def _value(node: ast.expr) -> object:
    return ast.literal_eval(node)


def _call_name(node: ast.expr) -> str:
    """'insertTableEntry' for self.insertTableEntry(...), 'KeyTuple' for gc.KeyTuple(...)."""
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _key(node: ast.Call) -> tuple[str, dict]:
    """tofino: gc.KeyTuple(name, value[, mask] | low=, high= | prefix_len=); bmv2: self.Exact(name, value),
    self.Ternary(name, value, mask), self.Lpm(name, value, prefix_len), self.Range(name, low, high)."""
    name, *args = (_value(a) for a in node.args)
    kw = {k.arg: _value(k.value) for k in node.keywords}
    kind = _call_name(node)
    if kind == "Optional":
        raise ValueError(f"key {name}: optional matches are not kept in vectors")
    if kind == "Range":
        return name, {"low": args[0], "high": args[1]}
    if "low" in kw:
        return name, {"low": kw["low"], "high": kw["high"]}
    if kind == "Lpm":
        return name, {"value": args[0], "prefix_len": args[1]}
    if "prefix_len" in kw:
        return name, {"value": args[0], "prefix_len": kw["prefix_len"]}
    if len(args) == 2:
        return name, {"value": args[0], "mask": args[1]}
    return name, {"value": args[0]}


def _table_call(call: ast.Call) -> dict:
    kind = _call_name(call)
    if kind == "table_add":  # bmv2: ((table, [keys]), (action, [(param, value)]), priority)
        (table, keys), (action, data) = (arg.elts for arg in call.args[:2])
        entry = {"table": _value(table), "key": dict(_key(k) for k in keys.elts), "action": _value(action),
                 "params": {_value(d.elts[0]): _value(d.elts[1]) for d in data.elts}}
        priority = _value(call.args[2]) if len(call.args) > 2 else None
        return entry if priority is None else {**entry, "priority": priority}
    if kind == "insertTableEntry":
        table, keys, action, data = call.args
        return {"table": _value(table), "key": dict(_key(k) for k in keys.elts),
                "action": _value(action), "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}
    table, action, data = call.args  # overrideDefaultEntry
    return {"table": _value(table), "default": True, "action": _value(action),
            "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}


def _register_call(call: ast.Call) -> dict:
    name, value, index = call.args
    raw = _value(value)
    if isinstance(raw, list):  # a struct register: [('reg.field', value), ...]
        raw = {field.rsplit(".", 1)[1]: v for field, v in raw}
    return {"register": _value(name), "index": _value(index), "value": raw}


def _assignments(body: list[ast.stmt]) -> dict[str, object]:
    out: dict[str, object] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
            if _call_name(value) == "Mask" and isinstance(value, ast.Call):
                value = value.args[0]  # bmv2: exp_pkt = Mask(b'...'); tofino: exp_pkt = b'...', then Mask(exp_pkt)
            try:
                out[stmt.targets[0].id] = _value(value)
            except ValueError:
                pass  # exp_pkt = Mask(exp_pkt)
    return out


def _dont_care(body: list[ast.stmt]) -> list[list[int]]:
    return [[_value(s.value.args[0]), _value(s.value.args[1])] for s in body
            if isinstance(s, ast.Expr) and _call_name(s.value) == "set_do_not_care"]


_EMIT_CALL = re.compile(r"\[MethodCall\]: \w+\.emit<(\w+)>")
_FIELD = re.compile(r"(\w+):([^;]*);")


def ingress_of(trace: str, deparser: str) -> dict | None:
    """From a test's path trace: what the ingress deparser emitted (each valid header and its fields, in order)
    and what the traffic manager was told: ``port``, or ``dropped``. None when the path never left the ingress
    deparser. (P4Testgen's output packet is what its egress made of it; its egress parser does not read what
    the ingress deparser emitted: docs/tofino.md.)"""
    start = trace.find(f'copy_in("{deparser}")')
    if start < 0:
        return None
    emitted: list[dict] = []
    header = None
    port: int | str | None = None
    dropped = False
    for line in trace[start:].splitlines():
        line = line.strip()
        if (call := _EMIT_CALL.search(line)) is not None:
            header = call[1]
        elif line.startswith("[Emit]:") and header is not None:
            fields = {k: (int(v) if v.strip().lstrip("-").isdigit() else v.strip())
                      for k, v in _FIELD.findall(line) if k != "headerValid"}
            emitted.append({"header": header, "fields": fields})
            header = None
        elif line.startswith("[Invalid emit"):
            header = None
        elif "egress_port = " in line and port is None:
            value = line.rsplit("= ", 1)[1].rstrip(";").strip('"')
            port = int(value) if value.isdigit() else value
        elif line.startswith("[Packet marked dropped"):
            dropped = True
            break
        elif "StartEgress" in line:
            break
    return {"emit": emitted, "port": None if dropped else port, "dropped": dropped}


_COMPUTED = re.compile(r"\| Computed: ([\w./]+) = (-?\d+);")
_PAIR_ACTION = re.compile(r"\[MethodCall\]: lane_(?:write|add|max|harvest|read)_(\d+)\(\);")
_REGISTER_OF = {"tag": "slot_tag", "epoch": "slot_tag", "bitmap": "slot_bitmap", "psn": "slot_bitmap"}


def writes_of(trace: str, control: str) -> list[dict]:
    """What every RegisterAction of ``control`` wrote back on the path, from its trace: P4Testgen's tofino target
    executes a RegisterAction's apply on the register's initial value but does not store the result (its
    source: "writing to a register has no effect"). Its trace has each assignment the apply made, with the
    computed value: ``value.<field> = v`` (``value`` is the apply's register parameter in every RegisterAction
    of the program), so the value written back is the initial value with those fields replaced. The register
    is known by its fields (slot_tag: tag, epoch; slot_bitmap: bitmap, psn; slot_overflow: no field) and, for
    a lane pair, by the lane action that ran it; slot_phase of the tree roles (p4/include/tofino_tree.p4) by
    its apply's parameter, ``phase``; the index is ``meta.slot_set`` (slot_tag's hash-unit index has the same
    bits). One entry per register and index: {register, index, fields} (``fields`` of slot_overflow and
    slot_phase: {"value": v}), values as unsigned words like setRegisterValue's."""
    start = trace.find(f'copy_in("{control}")')
    if start < 0:
        return []
    end = trace.find(f'copy_out("{control}")', start)
    out: dict[tuple[str, int], dict[str, int]] = {}
    index, pair = 0, None
    for line in trace[start:end if end >= 0 else None].splitlines():
        if (action := _PAIR_ACTION.search(line)) is not None:
            pair = int(action[1])
            continue
        computed = _COMPUTED.search(line)
        if computed is None:
            continue
        target, value = computed[1], int(computed[2])
        if target == "meta.slot_set":
            index = value
        elif target == "value":
            out.setdefault(("slot_overflow", index), {})["value"] = value % 0x100
        elif target == "phase":
            out.setdefault(("slot_phase", index), {})["value"] = value % 0x100
        elif target.startswith("value."):
            field = target.split(".", 1)[1]
            register = _REGISTER_OF.get(field) or (f"lane_pair_{pair}" if field in ("first", "second") else None)
            if register is None:
                raise ValueError(f"a register write to {target} this parser does not know")
            out.setdefault((register, index), {})[field] = value % (1 << 32)
    return [{"register": r, "index": i, "fields": f} for (r, i), f in out.items()]


_TABLE_CALLS = ("insertTableEntry", "overrideDefaultEntry", "table_add")


def without_traces(path: Path) -> str:
    """A PTF file without its tests' path traces (the triple-quoted blocks, megabytes per test), read line by
    line: a run of hundreds of bmv2 tests writes gigabytes."""
    kept, in_trace = [], False
    with path.open() as lines:
        for line in lines:
            if line.strip() == "'''":
                in_trace = not in_trace
            elif not in_trace:
                kept.append(line)
    return "".join(kept)


def parse_ptf(text: str, deparser: str | None = None) -> list[dict]:
    """Every test of a P4Testgen PTF file (of the tofino or the bmv2 target), in test order; with ``deparser``,
    each test also carries ``ingress`` (ingress_of) from its trace."""
    tests = []
    traces = {int(m[1]): m[2] for m in re.finditer(r"class Test(\d+)\(.*?'{3}(.*?)'{3}", text, flags=re.S)} \
        if deparser is not None else {}
    text = re.sub(r"'{3}.*?'{3}", "", text, flags=re.S)  # the path traces: megabytes each, not kept
    for cls in ast.parse(text).body:
        match = re.fullmatch(r"Test(\d+)", cls.name) if isinstance(cls, ast.ClassDef) else None
        if not match:
            continue
        methods = {f.name: f.body for f in cls.body if isinstance(f, ast.FunctionDef)}
        calls = [s.value for s in methods.get("setupCtrlPlane", []) if isinstance(s, ast.Expr)
                 and isinstance(s.value, ast.Call)]
        tables = [_table_call(c) for c in calls if _call_name(c) in _TABLE_CALLS]
        registers = [_register_call(c) for c in calls if _call_name(c) == "setRegisterValue"]
        unknown = sorted({_call_name(c) for c in calls} - {*_TABLE_CALLS, "setRegisterValue"})
        if unknown:
            raise ValueError(f"Test{match[1]}: control-plane calls this parser does not know: {unknown}")
        send = _assignments(methods.get("sendPacket", []))
        verify_body = methods.get("verifyPackets", [])
        verify = _assignments(verify_body)
        test: dict = {"id": int(match[1]), "tables": tables, "registers": registers,
                      "input": {"port": send["ig_port"], "packet": bytes(send["pkt"]).hex()}}
        if "eg_port" in verify:
            test["expect"] = {"port": verify["eg_port"], "packet": bytes(verify["exp_pkt"]).hex(),
                              "dont_care_bits": _dont_care(verify_body)}
        else:
            test["expect"] = None  # no packet leaves the switch
        if deparser is not None:
            test["ingress"] = ingress_of(traces.get(test["id"], ""), deparser)
            test["writes"] = writes_of(traces.get(test["id"], ""), "PassingIngress")
        tests.append(test)
    return sorted(tests, key=lambda t: t["id"])


_COVERAGE = re.compile(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)")  # p4testgen's line after each test


def _uncovered(log: str) -> list[str]:
    """The statements of the last "Not covered program nodes" list p4testgen printed (--print-coverage)."""
    blocks = log.split("Not covered program nodes:")
    if len(blocks) < 2:
        return []
    lines = []
    for line in blocks[-1].splitlines()[1:]:
        if not line.startswith("\t"):
            break
        lines.append(line.strip().replace(str(ROOT) + "/", ""))
    return lines


def _keep_complete_tests(out: Path, complete: int) -> None:
    """The PTF file of a run stopped by its budget with the test classes p4testgen finished: at most
    ``complete`` (the tests it printed a coverage line for), and a last one cut off while it was being written
    (a class ends with its runTest) left out."""
    for f in out.glob("*.py"):
        text = f.read_text()
        starts = [m.start() for m in re.finditer(r"\nclass Test", text)]
        if len(starts) > complete:
            text = text[:starts[complete] + 1]
            starts = starts[:complete]
        if starts and not text.rstrip().endswith("self.runTestImpl()"):
            text = text[:starts[-1] + 1]
        f.write_text(text)


def run_p4testgen(program: Program, run: Run, max_tests: int, seed: int, defines: dict[str, int],
                  extra: list[str], log_file: Path | None, source: Path | None = None,
                  coverage: bool = True, traces: bool = False) -> tuple[list[dict], dict]:
    """One p4testgen run of ``run`` over the program (or ``source``, a variant of it: a mutant); ``traces``: each
    test keeps its path's trace (``trace``; the v1model sequences read their register writes from it)."""
    tool = shutil.which("p4testgen")
    if tool is None:
        sys.exit("make p4-testgen: p4testgen not found; build p4c with its test tools (docs/tofino.md)")
    includes = [f"-I{P4C_SOURCE / d}" for d in TARGET_INCLUDES.get(program.target, ())]
    with tempfile.TemporaryDirectory(prefix="passing-testgen-") as out:
        args = [tool, "--target", program.target, "--arch", program.arch, "--std", "p4-16", *includes,
                *[f"-D{k}={v}" for k, v in {**TARGET_DEFINES.get(program.target, {}), **defines,
                                            **run.defines}.items()],
                "--test-backend", program.test_backend, "--seed", str(seed), "--max-tests", str(max_tests),
                *(("--track-coverage", "STATEMENTS", "--print-coverage") if coverage else ()), *run.args, *extra,
                "--out-dir", out, str(source or ROOT / program.source)]
        started = time.monotonic()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=run.seconds)
            stopped = False
        except subprocess.TimeoutExpired:  # the run's budget: the tests written so far are kept
            proc.terminate()
            log, _ = proc.communicate()
            stopped = True
        seconds = time.monotonic() - started
        if log_file is not None:
            log_file.write_text(log)
        if proc.returncode != 0 and not stopped:
            sys.exit(f"p4testgen failed ({proc.returncode}):\n{log[-5000:]}")
        if stopped:
            _keep_complete_tests(Path(out), len(_COVERAGE.findall(log)))
        # the tofino target's traces give each test's ingress output; the bmv2 target's are gigabytes
        tests = [t for f in sorted(Path(out).glob("*.py")) for t in
                 (parse_ptf(f.read_text(), program.ingress_deparser) if program.ingress_deparser
                  else parse_ptf(without_traces(f)))]
        if traces:
            found = {int(m[1]): m[2] for f in sorted(Path(out).glob("*.py"))
                     for m in re.finditer(r"class Test(\d+)\(.*?'{3}(.*?)'{3}", f.read_text(), flags=re.S)}
            for t in tests:
                t["trace"] = found.get(t["id"], "")
    for t in tests:
        t["run"] = run.name
    coverage = _COVERAGE.findall(log)
    meta = {"defines": run.defines, **({"stopped_after_s": run.seconds} if stopped else {}),
            "args": [a if a != out else "<out>" for a in args[1:-1] if not a.startswith("-I")],
            "seconds": round(seconds, 1), "tests": len(tests),
            "node_coverage": {"fraction": float(coverage[-1][0]), "covered": int(coverage[-1][1]),
                              "nodes": int(coverage[-1][2])} if coverage else None,
            "uncovered": None if stopped else _uncovered(log)}  # printed at a run's end alone
    return tests, meta
