"""Patch 14 (the cpu worker): large buffers freed by one forward are mapped
again by the next without page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A forward's large intermediates (48, 16, 16 and 32 MiB: above glibc's mmap
# threshold), allocated, written and freed, ten times; prints the page faults.
PROGRAM = """
import resource, sys, torch
if sys.argv[1] == "patched":
    from vllm_accel.patches import keep_large_buffers_mapped
    assert keep_large_buffers_mapped()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def forward():
    a = torch.ones(12 << 20)
    b = torch.ones(4 << 20) + 1
    c = a[: 8 << 20] * 2
    return (b.sum() + c.sum()).item()
forward()  # the first one maps its pages either way
before = faults()
for _ in range(10):
    forward()
print(faults() - before)
"""
PAGES_PER_FORWARD = (48 + 16 + 16 + 32) * 2**20 // 4096


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_buffers_stay_mapped_between_forwards():
    # glibc maps at least the 48 MiB buffer afresh every time.
    assert faults("default") > 10 * (48 * 2**20 // 4096)
    assert faults("patched") < 2 * PAGES_PER_FORWARD
