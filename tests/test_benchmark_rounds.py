"""benchmarks/common.py's resident rounds: each engine started once, one run of
every backend per round, and each round's ratio taken between the runs of that
round. Fake workers (a few lines of Python speaking the --resident protocol)
stand in for the engines."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "benchmarks_common", Path(__file__).resolve().parent.parent / "benchmarks" / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

# Speaks like _throughput_worker.py --resident: log lines on stdout too (vLLM
# logs there), a ready line, then one result line a line on stdin, its figure
# given by argv as a list a run at a time; a negative figure: exits mid-run;
# zero: hangs.
FAKE_WORKER = textwrap.dedent("""
    import json, sys, time
    figures = [float(x) for x in sys.argv[1].split(",")]
    print("INFO engine starting", flush=True)
    print(json.dumps({"ready": True, "load_s": 1.0}), flush=True)
    for run_no, line in enumerate(sys.stdin):
        print("{not json: a log line", flush=True)
        if figures[run_no] < 0:
            sys.exit(3)
        if figures[run_no] == 0:
            time.sleep(600)
        print(json.dumps({"run_no": run_no, "tok_s": figures[run_no]}), flush=True)
""")


def run_fake(tmp_path, figures, rounds=3, timeout=60):
    """common.paired_rounds over fake workers (``figures``: backend -> a figure a run),
    and the starts and runs in the order they came."""
    calls = []

    def start(name):
        calls.append(("start", name))
        worker = common.ResidentWorker([sys.executable, "-c", FAKE_WORKER, figures[name]], None,
                                       tmp_path / f"{name}.log", timeout)
        run = worker.run
        worker.run = lambda: (calls.append(("run", name)), run())[1]
        return worker, None
    return (*common.paired_rounds(list(figures), rounds, start, lambda res: f"{res['tok_s']}"),
            calls)


def test_paired_rounds_alternate_and_ratios_pair_the_same_round(tmp_path):
    results, errors, calls = run_fake(
        tmp_path, {"accel": "300,150,330", "native": "200,100,300"})
    assert errors == {}
    # Each run's result carries its engine's ready line.
    assert results["accel"][2] == {"ready": True, "load_s": 1.0, "run_no": 2, "tok_s": 330,
                                   "round": 3}
    # Engines start once, first to last; the order of a round reverses every other round.
    assert calls == [("start", "accel"), ("start", "native"),
                     ("run", "accel"), ("run", "native"), ("run", "native"), ("run", "accel"),
                     ("run", "accel"), ("run", "native")]
    assert [r["run_no"] for r in results["accel"]] == [0, 1, 2]
    assert [r["round"] for r in results["native"]] == [1, 2, 3]
    # Round by round: 1.5, 1.5, 1.1 (a ratio of medians would read 300 / 200 = 1.5 too,
    # and a ratio of one backend's round 2 with the other's round 1 would not pair).
    assert common.round_ratios(results, "accel", "native", "tok_s") == dict(
        median=1.5, min=1.1, max=1.5, runs=[1.5, 1.5, 1.1])
    # The workers' other stdout lines went to their logs, after stderr.
    assert "{not json: a log line" in (tmp_path / "accel.log").read_text()


def test_a_worker_that_dies_is_reported_and_the_others_go_on(tmp_path):
    results, errors, _ = run_fake(tmp_path, {"accel": "300,-1,330", "native": "200,100,300"})
    assert "accel.log" in errors["accel"]
    assert [r["tok_s"] for r in results["accel"]] == [300]
    assert [r["tok_s"] for r in results["native"]] == [200, 100, 300]
    # Only round 1 has both: the ratio pairs that round alone.
    assert common.round_ratios(results, "accel", "native", "tok_s")["runs"] == [1.5]


def test_a_worker_past_its_timeout_is_killed_and_reported(tmp_path):
    results, errors, _ = run_fake(tmp_path, {"accel": "300,0,330", "native": "200,100,300"},
                                  timeout=2)
    assert "within 2 s" in errors["accel"]
    assert [r["tok_s"] for r in results["accel"]] == [300]
    assert len(results["native"]) == 3


def test_a_worker_gone_while_idle_is_reported(tmp_path):
    worker = common.ResidentWorker([sys.executable, "-c", FAKE_WORKER, "300"], None,
                                   tmp_path / "w.log", timeout=60)
    worker._proc.kill()  # as the OS would kill an idle engine
    worker._proc.wait()
    with pytest.raises(RuntimeError, match="w.log"):
        worker.run()
    worker.close()
