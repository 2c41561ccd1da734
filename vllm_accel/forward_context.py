"""Everything that steers one forward, as one explicit object.

Compiled graphs call our ops with tensors only, so what a forward needs beyond
its tensors cannot be an argument: the step's attention layout, how many rows
of a padded call hold data, which CPU kernels run, whether this is warmup,
where inductor keeps what it compiles. As with vLLM's ``set_forward_context``,
whoever runs a forward (the runner for a step, the vision encoder for an
encoder call, warmup) sets one ``ForwardContext`` around it, and the ops and
compiled layers read it with ``get_forward_context()``. Nothing else steers
them, and outside a forward the context is empty (no kernels, no layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_accel.kernels import NO_KERNELS, CpuKernels
from vllm_accel.patches import inductor_cache_dir

if TYPE_CHECKING:
    from vllm_accel.model.mamba2 import RecurrentLayout
    from vllm_accel.model.paged_attention import AttentionLayouts


@dataclass(frozen=True)
class ForwardContext:
    # The step's token layout the paged attention op reads, one per (KV
    # cache group, window) of the attention layers (one unless they are of
    # several kinds, e.g. windowed and full); None: no paged attention runs,
    # e.g. a vision tower's call.
    attention: AttentionLayouts | None = None
    # The step's requests as segments of the forward with their recurrent
    # state's blocks, for the layers that keep one (Mamba2); None: none run.
    recurrent: RecurrentLayout | None = None
    # The CPU kernels this engine runs (each None: oneDNN's or torch's path).
    kernels: CpuKernels = NO_KERNELS
    # A call padded to a bucket: tensors whose rows are exactly ``padded_rows``
    # hold data in their first ``live_rows`` (0: nothing padded). Ops that work
    # row by row (our linear kernel) skip the rest and leave zeros there. Only
    # a tensor whose rows are the padded axis counts (a forward's [1, tokens,
    # ...], Qwen2.5-VL's [patches, ...]); others run whole.
    padded_rows: int = 0
    live_rows: int = 0
    # Warmup of a compiled layer stack: a layer whose kind of call another
    # layer of its stack already ran takes dynamo's graph for it without
    # computing (model/compile.py). Outputs are meaningless then.
    warming_up: bool = False
    # Where inductor keeps what it compiles during this forward (None: leave
    # inductor's own setting). Set while an engine may compile (warmup, or
    # serving without warmup), never on a warmed-up engine's steps.
    compile_cache_dir: Path | None = None

    def rows_to_compute(self, rows: int) -> int:
        """Of a tensor's ``rows`` (its leading axes flattened), how many hold data."""
        return self.live_rows if rows == self.padded_rows and self.live_rows < rows else rows

    def padded(self, padded_rows: int, live_rows: int) -> ForwardContext:
        """This context for a call whose ``padded_rows`` rows hold data in the
        first ``live_rows``."""
        return dataclasses.replace(self, padded_rows=padded_rows, live_rows=live_rows)


_current = ForwardContext()


@contextlib.contextmanager
def set_forward_context(context: ForwardContext):
    """Make ``context`` the one the ops read within the block (and point
    inductor at its compile cache directory, if it names one)."""
    global _current
    previous, _current = _current, context
    try:
        with inductor_cache_dir(context.compile_cache_dir):
            yield context
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """The context of the forward running now (an empty one outside any)."""
    return _current
