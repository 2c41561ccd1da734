"""Counting torch.compile work (graphs compiled during warmup and at run time)
and where compiled graphs persist.

Dynamo's process-wide counters are read as deltas, so several engines in one
process (tests) each see their own numbers. A compile after warmup is a
recompile: the thing an accelerator user must never pay for while serving.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from torch._dynamo.utils import counters, get_compilation_metrics
from vllm.logger import init_logger

# A child of the "vllm" logger: same handler, format and VLLM_LOGGING_LEVEL.
logger = init_logger(f"vllm.{__name__}")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _cache_hits() -> tuple[int, int]:
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


_INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class CompileStats:
    def __init__(self) -> None:
        self._start = self._seen = _graphs()
        self._start_hits = _cache_hits()
        self.warmup_graphs = 0
        self.runtime_compiles = 0
        self.warmed_up = False
        self.cache_dir: Path | None = None

    @property
    def graphs_compiled(self) -> int:
        return _graphs() - self._start

    @property
    def cache_hits(self) -> tuple[int, int]:
        hits, misses = _cache_hits()
        return hits - self._start_hits[0], misses - self._start_hits[1]

    def configure(self, cache_dir: Path) -> None:
        """Persist this engine's compiled graphs under cache_dir."""
        self.cache_dir = cache_dir / "inductor"
        logger.info("vllm_accel compile cache: %s", self.cache_dir)

    @contextlib.contextmanager
    def cache_scope(self):
        """Inductor reads its cache directory from the environment at each
        compile; point it at ours only while our model runs (a compile can
        happen in any step), so other code in the process keeps its own."""
        if self.cache_dir is None:
            yield
            return
        previous = os.environ.get(_INDUCTOR_CACHE_ENV)
        os.environ[_INDUCTOR_CACHE_ENV] = str(self.cache_dir)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(_INDUCTOR_CACHE_ENV, None)
            else:
                os.environ[_INDUCTOR_CACHE_ENV] = previous

    def finish_warmup(self) -> None:
        self.warmup_graphs = self.graphs_compiled
        self._seen = _graphs()
        self.warmed_up = True

    def after_step(self, what: str) -> None:
        """Count graphs compiled since the last call; after warmup each one is
        a recompile, logged with the function dynamo compiled and ``what`` ran."""
        now = _graphs()
        if now == self._seen:
            return
        new, self._seen = now - self._seen, now
        if self.warmed_up:
            self.runtime_compiles += new
            logger.warning(
                "vllm_accel recompile at run time: %d new graph(s) during %s, compiling %s "
                "(runtime recompiles: %d)", new, what, _compiled_functions(new),
                self.runtime_compiles,
            )


def _compiled_functions(count: int) -> str:
    """Name and place of the functions behind dynamo's last ``count`` compiles."""
    metrics = list(get_compilation_metrics())[-count:]
    return ", ".join(f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" for m in metrics) \
        or "unknown functions"
