"""Counting torch.compile work (graphs compiled during warmup and at run time)
and where compiled graphs persist.

Dynamo's process-wide counters are read as deltas, so several engines in one
process (tests) each see their own numbers. A compile after warmup is a
recompile: the thing an accelerator user must never pay for while serving.
"""

from __future__ import annotations

from pathlib import Path

from vllm_accel.compat import (dynamo_graph_count, inductor_cache_counts,
                               inductor_tuning_benchmarks, last_compiled_functions)
from vllm_accel.log import get_logger
from vllm_accel.kernels import ops
from vllm_accel.model import saved_graphs

logger = get_logger(__name__)


class CompileStats:
    def __init__(self) -> None:
        self.restart()
        self.warmup_graphs = 0
        self.runtime_compiles = 0
        self.warmed_up = False
        self.cache_dir: Path | None = None
        self.saved_graphs_dir: Path | None = None

    def restart(self) -> None:
        """Count from now (before warmup): what compiled before is not ours."""
        self._start = self._seen = dynamo_graph_count()
        self._start_hits = inductor_cache_counts()
        self._start_saved = saved_graphs.counts()
        self._start_tuning = inductor_tuning_benchmarks()

    @property
    def graphs_compiled(self) -> int:
        return dynamo_graph_count() - self._start

    @property
    def graphs_loaded(self) -> int:
        """Graphs loaded whole from the saved ones (model/saved_graphs.py)."""
        return saved_graphs.counts()[0] - self._start_saved[0]

    @property
    def cache_hits(self) -> tuple[int, int]:
        """Graphs the compile cache gave (inductor's cache, or saved whole)
        and graphs it did not have (compiled)."""
        hits, misses, _ = inductor_cache_counts()
        saved_compiles = saved_graphs.counts()[1] - self._start_saved[1]
        return (hits - self._start_hits[0] + self.graphs_loaded,
                misses - self._start_hits[1] + saved_compiles)

    @property
    def cache_bypasses(self) -> int:
        """Graphs inductor compiled without its cache (it cannot cache them)."""
        return inductor_cache_counts()[2] - self._start_hits[2]

    @property
    def tuning_benchmarks(self) -> int:
        """Inductor's tuning since the count started (compat.py says what is
        counted): a start whose graphs and tuning came from the cache needs none."""
        return inductor_tuning_benchmarks() - self._start_tuning

    def configure(self, cache_dir: Path) -> None:
        """Persist this engine's compiled graphs under cache_dir (inductor
        uses it while the engine's model runs: patches.inductor_cache_dir), in
        a folder of our ops' schemas (graphs call them: see ops.py)."""
        self.cache_dir = cache_dir / "inductor" / f"ops-{ops.fingerprint()}"
        self.saved_graphs_dir = cache_dir / "graphs" / f"ops-{ops.fingerprint()}"
        logger.info("vllm_accel compile cache: %s", self.cache_dir)

    def finish_warmup(self) -> None:
        self.warmup_graphs = self.graphs_compiled + self.graphs_loaded
        self._seen = dynamo_graph_count()
        self.warmed_up = True

    def after_step(self, what: str) -> None:
        """Count graphs compiled since the last call; after warmup each one is
        a recompile, logged with the function dynamo compiled and ``what`` ran."""
        now = dynamo_graph_count()
        if now == self._seen:
            return
        new, self._seen = now - self._seen, now
        if self.warmed_up:
            self.runtime_compiles += new
            logger.warning(
                "vllm_accel recompile at run time: %d new graph(s) during %s, compiling %s "
                "(runtime recompiles: %d)", new, what, last_compiled_functions(new),
                self.runtime_compiles,
            )

