"""Static-shape buckets (a leaf module: it imports nothing from vllm_accel).

A compiled graph has fixed shapes, so work is padded up to the smallest bucket
that fits. Two axes matter here:

- tokens per forward: every step runs one forward over all its tokens (decodes
  and prefill chunks packed together), padded to a token bucket; one compiled
  graph per token bucket;
- context length, in KV blocks: decode attention pads its block tables to a
  context bucket;
- vision rows per image (tiles, patches, crops): the compiled encoder pads to
  a vision bucket.

A bucket list comes from a spec string: ``"1,8,64,512"`` (explicit),
``"exp:min=1,max=2048,limit=8"`` (powers-of-two steps, at most ``limit``
buckets) or ``"lin:min=64,step=64,max=512"``; missing fields take the defaults
derived from the engine configuration.
"""

from __future__ import annotations

import bisect
from vllm.logger import init_logger
import math

logger = init_logger(f"vllm.{__name__}")

_STRATEGIES = {"exp": ("min", "max", "limit"), "lin": ("min", "step", "max")}
DEFAULT_LIMIT = 8


def parse_bucket_spec(spec: str) -> tuple[str, dict[str, int]]:
    """Return ("list", {value: value}) or (strategy, fields); raise on bad input."""
    spec = spec.strip().lower()
    allowed = (
        'a comma-separated list of positive integers ("1,8,64"), '
        '"exp:min=A,max=B,limit=N" or "lin:min=A,step=S,max=B"'
    )
    if ":" not in spec:
        try:
            values = [int(v) for v in spec.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"expected {allowed}") from None
        if not values or min(values) < 1:
            raise ValueError(f"expected {allowed}")
        return "list", {v: v for v in values}
    strategy, _, body = spec.partition(":")
    if strategy not in _STRATEGIES:
        raise ValueError(f"unknown bucket strategy '{strategy}'; expected {allowed}")
    fields: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, _, value = item.partition("=")
        if key not in _STRATEGIES[strategy] or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"bad field '{item}' for '{strategy}'; it takes "
                f"{', '.join(_STRATEGIES[strategy])} (positive integers)"
            )
        fields[key] = int(value)
    return strategy, fields


def exponential_buckets(lo: int, hi: int, limit: int = DEFAULT_LIMIT) -> list[int]:
    """lo, lo*2^k, lo*2^2k, ... up to hi (always included), k chosen so that
    there are at most ``limit`` buckets."""
    lo, hi = max(1, lo), max(lo, hi)
    octaves = math.log2(hi / lo)
    step = max(1, math.ceil(octaves / max(1, limit - 1)))
    buckets = []
    value = lo
    while value < hi:
        buckets.append(value)
        value *= 2**step
    return buckets + [hi]


def linear_buckets(lo: int, step: int, hi: int) -> list[int]:
    buckets = list(range(lo, hi, step))
    return buckets + [hi] if not buckets or buckets[-1] != hi else buckets


def make_buckets(spec: str, default_min: int, default_max: int) -> list[int]:
    """The bucket list for a spec ("" means the derived exponential default)."""
    strategy, fields = parse_bucket_spec(spec) if spec else ("exp", {})
    if strategy == "list":
        return sorted(fields)
    lo = fields.get("min", default_min)
    hi = fields.get("max", default_max)
    if strategy == "exp":
        return exponential_buckets(lo, hi, fields.get("limit", DEFAULT_LIMIT))
    return linear_buckets(lo, fields.get("step", lo), hi)


def find_bucket(buckets: list[int], size: int) -> int | None:
    """The smallest bucket >= size, or None when size exceeds them all."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


def fit_bucket(buckets: list[int], size: int, what: str, setting: str) -> int:
    """The bucket ``size`` pads to; beyond every bucket, ``size`` itself (runs
    unpadded, a new graph when compiling) with a warning that names ``setting``."""
    bucket = find_bucket(buckets, size)
    if bucket is not None:
        return bucket
    logger.warning(
        "vllm_accel: %d %s exceed every bucket %s; running unpadded (a new compiled "
        "graph when compiling). Add a bucket >= %d to %s.", size, what, buckets, size, setting,
    )
    return size
