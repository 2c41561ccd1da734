"""Where a cold engine start spends its time, by sampling every thread's stack.

One cold ``LLM()`` (empty compile, Triton, inductor and vLLM caches) with the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the model and
options of ``gpu.py``. A thread samples every other thread's Python stack each
``--interval`` seconds (a pass weighs by the time since the last). Each sample of a thread is put in a phase: the
outermost start-up step on its stack (model load, the memory profile, a warmup
bucket by its size, the sampling kernels, graph capture, ...). Printed per
thread and phase: its seconds, then the functions found most on its stacks
(inclusive seconds, each function counted once per sample; the trunk all its
samples share left out), and the innermost frames. Inductor's and
Triton's compile subprocesses are not sampled: time the main thread waits on
them shows as the wait.

    python benchmarks/start_profile.py --shape tinyllama --out start_profile.json
"""
import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import gpu

# Start-up steps: the outermost found on a stack names its phase.
PHASES = ("init_device", "load_model", "determine_available_memory",
          "initialize_from_config", "_run_bucket", "compile_sampling_kernels",
          "capture_graphs", "measure_forward_costs")


def _name(frame) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"


class StackSampler:
    """Samples every thread but its own into per-(thread, phase) counters."""

    def __init__(self, interval: float):
        self.interval = interval
        self.seconds = collections.Counter()  # (thread, phase) -> seconds
        self.functions = collections.defaultdict(collections.Counter)  # -> function -> seconds
        self.leaves = collections.defaultdict(collections.Counter)  # innermost frames only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()  # a pass may come late (the GIL): weigh it by its wait
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self._add(names.get(ident, str(ident)), frame, now - last)
            last = now

    def _add(self, thread: str, frame, seconds: float) -> None:
        stack = []
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        phase = "other"
        for f in reversed(stack):  # outermost first
            name = f.f_code.co_name
            if name in PHASES:
                phase = f"{name} {f.f_locals.get('bucket', '')}".strip()
                break
        key = (thread, phase)
        self.seconds[key] += seconds
        self.leaves[key][_name(stack[0])] += seconds
        for name in {_name(f) for f in stack}:
            self.functions[key][name] += seconds

    def report(self, top: int) -> dict:
        out = {}
        for (thread, phase), seconds in self.seconds.most_common():
            if seconds < 0.2:
                continue
            # The trunk every sample of the phase shares says nothing: left out.
            inclusive = [(name, s) for name, s in self.functions[(thread, phase)].most_common()
                         if s < 0.95 * seconds]
            out[f"{thread} / {phase}"] = {
                "seconds": round(seconds, 2),
                "functions": {name: round(s, 2) for name, s in inclusive[:top]},
                "innermost": {name: round(s, 2)
                              for name, s in self.leaves[(thread, phase)].most_common(top // 2)}}
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama", choices=sorted(gpu.SHAPES))
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default="start_profile.json")
    args = parser.parse_args()
    gpu.SHAPE = dict(gpu.SHAPES[args.shape])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                          ("VLLM_CACHE_ROOT", "vllm")):
            os.environ[name] = str(root / sub)
        model = gpu.make_model(root / "model")
        from vllm import LLM

        started = time.perf_counter()
        with StackSampler(args.interval) as sampler:
            llm = LLM(model=str(model), **gpu.engine_options(root / "compile"))
        llm_s = time.perf_counter() - started
        gpu.shutdown(llm)
    result = {"llm_s": round(llm_s, 2), "interval_s": args.interval,
              "phases": sampler.report(args.top)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("start_profile llm_s", result["llm_s"])
    for key, part in result["phases"].items():
        print(f"== {key}: {part['seconds']} s")
        for name, seconds in part["functions"].items():
            print(f"   {seconds:7.2f}  {name}")
        print("   innermost:", ", ".join(f"{n} {s}" for n, s in part["innermost"].items()))


if __name__ == "__main__":
    main()
