#!/usr/bin/env python3
"""What this machine's cores can do at most, by instruction, beside what a matmul reaches:
the ceilings the roofline line of throughput.py is read against.

  fp32 FMA      AVX-512 (or AVX2) fused multiply-adds on registers alone, 12 chains a thread
  AMX, no loads TDPBF16PS on tiles already loaded (the AMX unit's own rate)
  AMX, 1 group  the loop shape of our AMX linear kernel: one row tile and two weight tiles
                loaded from L1 for every two multiplies (five tiles in use)
  AMX, 2x2      the loop it ran before one group a pass: two row tiles and two weight
                tiles for every four multiplies (all eight tiles); and the same with the four
                sums stored after every pass over a K of 256 (a store waits for its tile's chain)
  tile loads    the 2x2 loop's loads alone, from L1, in GB/s: it loads 1 KB for every 32,768
                flops, so N GB/s of loads caps it at 32 N GFLOP/s
  AMX from L2   both loops over x (512 rows of K = 1,024) and weights (16 blocks) of 1 MB
                each, what a prompt's call reads from L2: x's rows 2 KB apart, as our kernel
                reads them up to 1,024 rows, or laid out in 1 KB tiles, as it copies an
                encoder's MLP rows
  read          a sequential read of 256 MB (DRAM) and of 16 MB (what the L3 holds)

Every figure uses all the cores this process may run on (OpenMP, one thread a core); rounds
alternate the measures and figures are medians with their min-max. The loops
(instruction_peaks.cpp) are built as the engine's kernels are (cpu_kernels.build).

    .venv/bin/python benchmarks/instruction_peaks.py [--rounds 5] [--seconds 0.5]
"""
import argparse
import ctypes
import os
import statistics
import tempfile
from pathlib import Path

from common import BENCH, CORES, machine, machine_text

from vllm_accel.kernels import build as cpu_kernels


def build() -> ctypes.CDLL:
    """The scratch loops (instruction_peaks.cpp) through the engine's own kernel build."""
    library = ctypes.CDLL(str(cpu_kernels.build(BENCH / "instruction_peaks.cpp",
                                                Path(tempfile.mkdtemp(prefix="vllm-accel-peaks-")))))
    for name in ("fma_gflops", "amx_rate", "read_gbs"):
        getattr(library, name).restype = ctypes.c_double
    library.fma_gflops.argtypes = [ctypes.c_double]
    library.amx_rate.argtypes = [ctypes.c_double, ctypes.c_int, ctypes.c_int]
    library.read_gbs.argtypes = [ctypes.c_double, ctypes.c_long]
    return library


def main() -> None:
    # One thread a core: read when the library below loads its OpenMP.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(CORES)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    lib, s = build(), args.seconds
    measures = {
        "fp32 FMA, GFLOP/s": lambda: lib.fma_gflops(s),
        "bf16 AMX, no loads, GFLOP/s": lambda: lib.amx_rate(s, 0, 1),
        "bf16 AMX, 1 group a pass, tiles loaded from L1, GFLOP/s": lambda: lib.amx_rate(s, 1, 0),
        "bf16 AMX, 2x2 tiles loaded from L1, GFLOP/s": lambda: lib.amx_rate(s, 1, 1),
        "bf16 AMX, the same, sums stored every 8 steps, GFLOP/s": lambda: lib.amx_rate(s, 2, 1),
        "AMX tile loads alone, from L1, GB/s": lambda: lib.amx_rate(s, 3, 1),
        "bf16 AMX, 1 group a pass from L2, x's rows 2 KB apart, GFLOP/s":
            lambda: lib.amx_rate(s, 4, 0),
        "bf16 AMX, 1 group a pass from L2, x in 1 KB tiles, GFLOP/s":
            lambda: lib.amx_rate(s, 5, 0),
        "bf16 AMX, 2x2 from L2, x's rows 2 KB apart, GFLOP/s": lambda: lib.amx_rate(s, 4, 1),
        "bf16 AMX, 2x2 from L2, x in 1 KB tiles, GFLOP/s": lambda: lib.amx_rate(s, 5, 1),
        "read 256 MB, GB/s": lambda: lib.read_gbs(s, 256),
        "read 16 MB, GB/s": lambda: lib.read_gbs(s, 16),
    }
    figures = {name: [] for name in measures}
    for round_ in range(args.rounds):
        for name in (list(measures) if round_ % 2 == 0 else list(reversed(measures))):
            figures[name].append(measures[name]())
    print(f"instruction peaks on {machine_text(machine())}, {args.rounds} rounds:")
    for name, values in figures.items():
        if min(values) < 0:
            print(f"  {name}: none here (no AMX in this build or the OS refuses it)")
        else:
            print(f"  {name}: {statistics.median(values):,.1f} "
                  f"({min(values):,.1f}-{max(values):,.1f})")


if __name__ == "__main__":
    main()
