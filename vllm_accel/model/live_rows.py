"""How many rows of a padded call hold real data, for the ops that skip the rest.

Compiled graphs have static shapes: a forward's tokens are padded to a token
bucket (40 decodes run as 48), an encoder call's patches to a vision bucket
(3,848 as 4,096), and every op in the graph computes the padding too. Our
opaque ops can do better where the work is per row: whoever pads (the runner
for a forward, the vision encoder for a call) says here how many rows are
real, the way the attention op reads its layout from ``attention_context``,
and ``linear_kernel`` multiplies only those, leaving zeros in the rest.

Only a tensor whose rows are exactly the padded axis counts (the padding
last: a forward's ``[1, tokens, ...]``, Qwen2.5-VL's ``[patches, ...]``); any
other shape runs whole (a tower's ``[tiles, 729, ...]``, or a merger's rows,
whose layout says nothing of where the padding is).
"""

from __future__ import annotations

import contextlib

_live: tuple[int, int] | None = None  # (padded rows, real rows) while some are padding


@contextlib.contextmanager
def live_rows(padded: int, real: int):
    """Within: tensors of ``padded`` rows hold data in their first ``real``."""
    global _live
    previous = _live
    _live = (padded, real) if real < padded else None
    try:
        yield
    finally:
        _live = previous


def count(rows: int) -> int:
    """Of a tensor's ``rows`` (its leading axes flattened), how many to compute."""
    if _live is not None and rows == _live[0]:
        return _live[1]
    return rows
