"""Static-shape buckets: the lists, their defaults, and how work is fitted to
them (below everything that uses them: it imports only the logger helper).

A compiled graph has fixed shapes, so work is padded up to the smallest bucket
that fits. Three axes:

- tokens per forward: a step's tokens (decodes and prefill chunks packed
  together) run as one forward padded to a token bucket, or as a few forwards
  of consecutive tokens when that pads less (``plan_forwards``); one compiled
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
import functools
import math
from dataclasses import dataclass

from vllm_accel.log import get_logger

logger = get_logger(__name__)

_STRATEGIES = {"exp": ("min", "max", "limit"), "lin": ("min", "step", "max")}
DEFAULT_LIMIT = 8

# Default token buckets, each warmed up at start-up and, where each has a
# graph of its own (settings.bucket_graphs), one more graph to compile. Small
# steps are mostly decodes, one row per running request: they double from 8
# to 64 so that a decode batch pads at most 2x, with 48 between 32 and 64 (48
# running requests padded to 64 computed a third more rows than needed); a
# lone decode keeps its own bucket (padded to 8 rows it took twice as long).
# Bigger steps are mostly prompts: 256 and 384 between 64 and 512 run a
# prompt of 129-384 tokens as one forward padded by at most half, not as
# forwards of 64 or padded to 512 (a shorter time to first token for a longer
# cold start). Steps beyond 512 run as forwards of 512 and a smaller one
# (plan_forwards). Measurements: benchmarks/README.md.
DEFAULT_TOKEN_BUCKETS = (1, 8, 16, 32, 48, 64, 256, 384, 512)
# What one more forward costs, in padded tokens (its fixed per-call work:
# Python, one pass over the weights, attention set-up), for cutting a step into
# forwards before the forwards' times are measured (warmup measures them;
# without warmup this estimate stays).
FORWARD_COST_IN_TOKENS = 32


def token_buckets(spec: str, max_step: int, whole_prompt: int = 1) -> list[int]:
    """The token buckets for a spec ("" = the defaults), none above the
    largest step the scheduler can send, the largest at least
    ``whole_prompt`` (an encoder's prompt runs in one forward)."""
    top = min(max_step, max(DEFAULT_TOKEN_BUCKETS[-1], whole_prompt))
    buckets = (make_buckets(spec, 1, top) if spec
               else [b for b in DEFAULT_TOKEN_BUCKETS if b < top] + [top])
    return [b for b in buckets if b <= max_step] or [max_step]


def context_buckets(spec: str, max_blocks: int) -> list[int]:
    """Context buckets, in KV blocks, for a spec. Decode attention runs
    outside the compiled graphs, so they cost no graphs: by default they step
    by half octaves, to pad less."""
    return make_buckets(spec, 1, max_blocks) if spec else half_octave_buckets(1, max_blocks)


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


def half_octave_buckets(lo: int, hi: int) -> list[int]:
    """lo, then steps of about x1.41 (two per doubling) up to hi: 1, 2, 3, 4, 6,
    8, 11, 16, 23, ... Pads at most ~41% where powers of two pad up to 100%."""
    buckets, value = [], max(1, lo)
    while value < hi:
        buckets.append(value)
        value = max(value + 1, round(value * 2**0.5))
    return buckets + [max(lo, hi)]


def thin_buckets(values: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the sorted ``values``, the largest always kept and
    the rest spread evenly below it (every bucket is a graph to compile)."""
    values = sorted(set(values))
    if len(values) <= limit:
        return values
    if limit == 1:
        return values[-1:]
    step = (len(values) - 1) / (limit - 1)
    return sorted({values[round(i * step)] for i in range(limit)})


def linear_buckets(lo: int, step: int, hi: int) -> list[int]:
    buckets = list(range(lo, hi, step))
    return buckets + [hi] if not buckets or buckets[-1] != hi else buckets


def make_buckets(spec: str, default_min: int, default_max: int,
                 default_limit: int = DEFAULT_LIMIT) -> list[int]:
    """The bucket list for a spec ("" means the derived exponential default)."""
    strategy, fields = parse_bucket_spec(spec) if spec else ("exp", {})
    if strategy == "list":
        return sorted(fields)
    lo = fields.get("min", default_min)
    hi = fields.get("max", default_max)
    if strategy == "exp":
        return exponential_buckets(lo, hi, fields.get("limit", default_limit))
    return linear_buckets(lo, fields.get("step", lo), hi)


@dataclass(frozen=True)
class ForwardCosts:
    """What one forward of each token bucket costs (any unit, one per bucket):
    as a step's first forward, and as a later one, which continues a prompt
    the forward before it cut and attends to all that forward wrote (on cpu
    it gathers that context: dearer than a prompt's start)."""

    first: tuple[float, ...]
    later: tuple[float, ...]

    @classmethod
    def measured(cls, first: list[float], later: list[float]) -> ForwardCosts:
        return cls(_non_decreasing(first), _non_decreasing(later))


def token_count_costs(buckets: list[int], overhead: int = FORWARD_COST_IN_TOKENS
                      ) -> ForwardCosts:
    """The estimate when nothing was measured: a forward costs its padded
    tokens plus ``overhead`` tokens for the call itself."""
    costs = tuple(float(b + overhead) for b in buckets)
    return ForwardCosts(costs, costs)


def _non_decreasing(costs: list[float]) -> tuple[float, ...]:
    """Measured costs made non-decreasing in the bucket size: a larger bucket
    does at least the work of a smaller one, and timing noise must not make a
    step pad to a larger bucket because it happened to time faster."""
    out, floor = [], 0.0
    for cost in costs:
        floor = max(floor, cost)
        out.append(floor)
    return tuple(out)


def plan_forwards(total: int, buckets: list[int], costs: ForwardCosts) -> list[int]:
    """The buckets of the forwards that run ``total`` tokens, in order: every
    forward but the last is full, the last pads up to its bucket.

    Minimises the summed cost of the forwards (``costs``: measured at warmup,
    or ``token_count_costs``): with a fixed cost of 32 tokens a forward, 370
    tokens with buckets 64, 256, 1024 run as 256 + 64 + 64 instead of one
    forward padded to 1024; beyond the largest bucket, full forwards of it.
    ``total`` equal to a bucket runs as that one forward unless smaller ones
    cost less in sum (never with the token-count estimate)."""
    largest = buckets[-1]
    full, rest = divmod(total, largest)
    if full:
        return [largest] * full + (list(_plan_later(tuple(buckets), costs.later)[1][rest])
                                   if rest else [])
    return list(_plans(tuple(buckets), costs)[total])


@functools.lru_cache(maxsize=8)
def _plans(buckets: tuple[int, ...], costs: ForwardCosts) -> list[tuple[int, ...]]:
    """plan[n] for every n <= the largest bucket: the first forward at its
    cost as a first one, the rest by ``_plan_later``."""
    totals, later = _plan_later(buckets, costs.later)
    plans = [()]
    for n in range(1, buckets[-1] + 1):
        first = min(range(len(buckets)), key=lambda i: costs.first[i] + (
            totals[n - buckets[i]] if buckets[i] < n else 0.0))
        b = buckets[first]
        plans.append((b,) + later[n - b] if b < n else (b,))
    return plans


@functools.lru_cache(maxsize=8)
def _plan_later(buckets: tuple[int, ...], costs: tuple[float, ...]
                ) -> tuple[list[float], list[tuple[int, ...]]]:
    """The cheapest forwards for every n <= the largest bucket (and their
    cost), by dynamic programming over the first of them: total(n) = min over
    buckets b of cost(b) + total(n - b)."""
    totals, plans = [0.0], [()]
    for n in range(1, buckets[-1] + 1):
        def after(i: int) -> float:  # n tokens, starting with a forward of bucket i
            b = buckets[i]
            return costs[i] + (totals[n - b] if b < n else 0.0)
        best = min(range(len(buckets)), key=after)
        b = buckets[best]
        totals.append(after(best))
        plans.append((b,) + plans[n - b] if b < n else (b,))
    return totals, plans


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
