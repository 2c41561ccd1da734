"""Ending a server started in its own process group (tests and benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


def end_process_group(proc: subprocess.Popen, deadline: float) -> None:
    """Wait for proc's process group to end (a `vllm serve` still starting up
    may not react to SIGTERM), killing what is left at the deadline."""
    while time.time() < deadline:
        proc.poll()  # reap the leader
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
