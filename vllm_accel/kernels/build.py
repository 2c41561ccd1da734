"""Building our C++ CPU kernels (decode_attention.cpp, span_attention.cpp,
linear_kernel.cpp) on the user's machine, and loading them.

Each kernel is plain C++ with OpenMP and a C ABI. The compiler inductor
already needs builds it in a few seconds, into the compile cache's
``kernels/`` folder, once per source, headers, compiler flags and CPU;
``build_in_background`` starts the builds while the model loads. It links
the OpenMP runtime torch has already loaded (same soname), so it shares
torch's threads instead of adding a pool.

Where the CPU has AMX, the matmul kernels (linear layers, span attention)
run bfloat16 only if they multiply on its tiles: AVX-512 BF16 dot products
lose to oneDNN's matmul and torch's flash attention on such a CPU
(benchmarks/README.md). The decode kernel, which reads the KV cache more than
it multiplies, runs bfloat16 on every AVX-512 BF16 CPU.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shlex
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from vllm_accel.log import get_logger

logger = get_logger(__name__)

# -ffast-math without its finite-math part: reassociated sums vectorize, but
# NaN and Inf keep their meaning (with -ffinite-math-only GCC may swap a max's
# operands, and a NaN score then vanished from a softmax). Never linked with
# it either: GCC would add start-up code flushing denormals for the process.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                 "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-fPIC",
                 "-std=c++17"]
LINK_FLAGS = ["-shared", "-fopenmp"]


# Builds this process started, by library: a second caller waits for the first's.
_builds: dict[Path, Future] = {}
_builds_lock = threading.Lock()


def build(source: Path, cache_dir: Path) -> Path:
    """The shared library of ``source`` under ``cache_dir``, built if missing
    (or waited for, if this process is building it). Raises OSError or
    CalledProcessError when it cannot be built."""
    compiler = os.environ.get("CXX", "g++")
    text = source.read_bytes()
    key = hashlib.sha256()
    for part in (text, *_local_headers(source.parent, text), compiler,
                 " ".join(COMPILE_FLAGS + LINK_FLAGS), platform.machine(), _cpu_model()):
        key.update(part if isinstance(part, bytes) else part.encode())
    library = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    with _builds_lock:
        future = _builds.get(library)
        ours = future is None
        if ours:
            future = _builds[library] = Future()
    if ours:
        try:
            future.set_result(_compile(shlex.split(compiler), source, library))
        except BaseException as error:
            future.set_exception(error)
    return future.result()


def build_in_background(sources: list[Path], cache_dir: Path) -> None:
    """Start building each of ``sources`` on a thread of its own: the
    compiler runs as processes, so the builds overlap each other and what
    the caller does meanwhile (loading weights). ``build`` (and ``load``)
    then wait for them; a failed build raises there."""
    for source in sources:
        threading.Thread(target=_build_quietly, args=(source, cache_dir), daemon=True,
                         name=f"build {source.stem}").start()


def _build_quietly(source: Path, cache_dir: Path) -> None:
    try:
        build(source, cache_dir)
    except (OSError, subprocess.CalledProcessError):
        pass  # kept in _builds: whoever loads the kernel logs it


def _compile(cxx: list[str], source: Path, library: Path) -> Path:
    cache_dir = library.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # Build beside the target, then rename: workers starting together never
    # load a half-written library.
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        obj, partial = Path(tmp) / "kernel.o", Path(tmp) / library.name
        for command in ([*cxx, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                        [*cxx, *LINK_FLAGS, str(obj), "-o", str(partial)]):
            subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)
    logger.info("vllm_accel %s kernel built in %.1f s: %s", source.stem,
                time.perf_counter() - start, library)
    return library


def load(kernel_class, source: Path, cache_dir: Path, instead: str):
    """``kernel_class`` over the library of ``source`` (built into ``cache_dir``
    if missing), or None. A failed build is a fault of the machine (no
    compiler, a broken one): it warns with the compiler's message and what
    runs ``instead``. A CPU the kernel has no instructions for is not a fault:
    logged at info. Sets the kernel's ``dtypes`` (what the engine runs by
    it) to its ``runs`` (what its build runs here) but bfloat16 where the CPU
    has AMX and the kernel does not multiply on its tiles (``multiplies_on_amx``;
    see the module's docstring)."""
    try:
        kernel = kernel_class(build(source, cache_dir))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (getattr(error, "stderr", "") or str(error)).strip()
        logger.warning("vllm_accel: the %s kernel could not be built, %s: %s", source.stem,
                       instead, detail)
        return None
    if not kernel.runs:
        logger.info("vllm_accel: %s kernel unavailable (no AVX-512 or AVX2 it runs), %s",
                    source.stem, instead)
        return None
    kernel.dtypes = set(kernel.runs)
    if (torch.bfloat16 in kernel.dtypes and "amx_bf16" in (cpu_flags() or ())
            and not kernel.multiplies_on_amx):
        kernel.dtypes.discard(torch.bfloat16)
        logger.info("vllm_accel: %s kernel in float32 only, bfloat16 %s (AMX)",
                    source.stem, instead)
    return kernel


@functools.cache
def _host_cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The fields of /proc/cpuinfo text, each as the first processor gives it."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The host CPU's feature flags (x86 ``flags``, Arm ``Features`` in
    /proc/cpuinfo, or the text given); None where they cannot be read."""
    cpuinfo = _host_cpuinfo() if cpuinfo is None else cpuinfo
    fields = _first_cpu(cpuinfo or "")
    value = fields.get("flags", fields.get("Features"))
    return None if value is None else set(value.split())


def _local_headers(folder: Path, source: bytes) -> list[bytes]:
    """The text of each ``#include "..."`` header (beside the source, in
    ``folder``) that ``source`` names: a change to one must rebuild the kernel."""
    names = re.findall(rb'^#include "([^"]+)"', source, flags=re.MULTILINE)
    return [(folder / name.decode()).read_bytes() for name in names]


def _cpu_model() -> str:
    """The CPU's model name and flags: -march=native code runs only on such a CPU."""
    cpuinfo = _host_cpuinfo()
    if cpuinfo is None:
        return platform.processor()
    fields = _first_cpu(cpuinfo)
    return fields.get("model name", "") + fields.get("flags", "")
