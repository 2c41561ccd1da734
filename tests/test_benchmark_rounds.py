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


# A warm start's log on an H100 (engine core spawned), as startup.py's child wrote it.
START_LOG = textwrap.dedent("""\
    (MainProcess pid=1635) WARNING 12-06 19:01:37 [system_utils.py:154] We must use the `spawn` multiprocessing start method. Overriding VLLM_WORKER_MULTIPROC_METHOD to 'spawn'.
    (EngineCore pid=2081) INFO 12-06 18:47:56 [warmup.py:151] vllm_accel warmup finished in 13.0 s: 10 graphs (compile cache hits 9, misses 0)
    (EngineCore pid=2081) INFO 12-06 18:47:57 [worker.py:207] vllm_accel captured 9 CUDA graphs (token buckets [1, 8, 16, 32, 48, 64, 256, 384, 512], any forward) in 0.2 s
    (EngineCore pid=2081) INFO 12-06 18:47:57 [cuda.py:153] vllm_accel sampling kernels compiled for batch sizes 1-64 in 0.1 s
    (EngineCore pid=2081) INFO 12-06 18:47:57 [worker.py:220] vllm_accel start-up: model load 1.1 s, KV cache 0.0 s, warmup 13.3 s (10 graphs, 9 from the compile cache)
    (EngineCore pid=2081) INFO 12-06 18:47:57 [core.py:405] init engine (profile, create kv cache, warmup model) took 15.69 s (compilation: 13.28 s)
    STARTUP_RESULT {"import_s": 12.91, "llm_s": 30.82, "front_end_initialized_cuda": false}
    """)


def test_a_start_log_gives_its_parts(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import startup

    got = startup.parse_start_log(START_LOG)
    assert got == {"import_s": 12.91, "llm_s": 30.82, "front_end_initialized_cuda": False,
                   "init_engine_s": 15.69, "load_s": 1.1, "kv_s": 0.0, "warmup_s": 13.3,
                   "graphs": 10.0, "cache_hits": 9.0, "buckets_s": 13.0, "cuda_graphs_s": 0.2,
                   "sampling_kernels_s": 0.1, "forced_spawn": True}
    tuned = START_LOG.replace("from the compile cache)",
                              "from the compile cache), 228 kernel tuning benchmarks")
    assert startup.parse_start_log(tuned)["tuning_benchmarks"] == 228.0
    forked = startup.parse_start_log(START_LOG.split("\n", 1)[1])
    assert forked["forced_spawn"] is False
    assert startup.parse_start_log(START_LOG.rsplit("STARTUP_RESULT", 1)[0]) is None
