"""All vllm-accel settings, in one typed place.

Each setting can come from an environment variable (``VLLM_ACCEL_*``; a few
keep vllm-gaudi's names, e.g. ``VLLM_SKIP_WARMUP``) or from vLLM's
``--additional-config '{"accel": {"<key>": ...}}'``; the additional config wins
because it is the more explicit of the two. An invalid value fails at start-up
with a message naming the variable and the allowed values.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from vllm_accel.buckets import parse_bucket_spec

ENV_PREFIX = "VLLM_ACCEL_"
ADDITIONAL_CONFIG_KEY = "accel"
# Settings whose environment variable keeps vllm-gaudi's name.
GAUDI_ENV_NAMES = {
    "skip_warmup": "VLLM_SKIP_WARMUP",
    "multimodal_buckets": "VLLM_MULTIMODAL_BUCKETS",
}


@dataclass(frozen=True)
class AccelSettings:
    # Memory for the paged KV cache, in GiB (like vLLM CPU's VLLM_CPU_KVCACHE_SPACE).
    kvcache_space: float = 4.0
    # Which device runs the model: "auto" picks "hpu" when habana_frameworks is
    # importable, else the CPU simulated accelerator; "cuda" (an NVIDIA GPU) is
    # chosen explicitly.
    device: str = "auto"
    # How the model is compiled: "auto" is "inductor" on cpu, "hpu_backend" on hpu;
    # "eager" runs the same bucketed shapes without compiling.
    compile_backend: str = "auto"
    # Compile lazily, on first use of each bucket, instead of during start-up.
    skip_warmup: bool = False
    # Token-count buckets of the compiled forward (see buckets.py): "" is
    # buckets.DEFAULT_TOKEN_BUCKETS (none above max_num_batched_tokens); "1,8,64,512"
    # is an explicit list; "exp:min=1,max=2048,limit=8" or "lin:min=64,step=64,max=512" a range.
    token_buckets: str = ""
    # How token buckets map to compiled graphs: "per_bucket" compiles a graph
    # for each bucket with its size fixed, as a static-shape accelerator must;
    # "shared" one graph for the token buckets above 1, its kernels reading
    # the token count at run time, and one for each vision tower's buckets
    # (forwards are still padded to buckets and every bucket is warmed up;
    # only compiling is shared: a cold start compiles 2 decoder graphs
    # instead of one per bucket). "auto": shared on cpu, the decoder's
    # shared and the vision tower's per bucket on cuda, per_bucket on hpu
    # (refuses shared).
    bucket_graphs: str = "auto"
    # Context-length buckets, in KV blocks, that decode attention pads to
    # ("" = half-octave steps up to max_model_len).
    context_buckets: str = ""
    # Vision buckets: the rows one vision encoder call takes (patches for
    # Qwen2.5-VL, as vllm-gaudi's VLLM_MULTIMODAL_BUCKETS; tiles for LlavaNext;
    # crops for Molmo); a step's images are packed into calls up to the largest.
    # "" derives them from the model and its processor.
    multimodal_buckets: str = ""
    # Where compiled graphs and the cpu kernels persist between starts
    # ("" = the user's cache dir).
    compile_cache_dir: str = ""
    # Threads the worker's torch ops may use; 0 leaves torch's default.
    num_threads: int = 0
    # cuda: replay decode-only steps from CUDA graphs captured at warmup (one
    # per token bucket); false runs them as compiled kernels launched one by one.
    cuda_graphs: bool = True
    # vLLM's async scheduling (the next step scheduled while the device runs
    # this one): "auto" keeps it where the device runs apart from the host
    # (cuda), "off" everywhere else, where the forward holds the host and
    # nothing overlaps; "on" keeps it on any device (tests use it on cpu);
    # "off" never. vLLM's --no-async-scheduling always wins.
    async_scheduling: str = "auto"
    # cpu: our C++ kernels (linear layers, decode and span attention); false
    # runs oneDNN's packed matmul and torch's attention instead.
    cpu_kernels: bool = True
    # How a step is cut into bucketed forwards: "tokens" by padded token
    # counts (the same cut on every start, so the same outputs); "measured" by
    # each bucket's forward time measured at warmup (can pick fewer, larger
    # forwards, but two starts can cut a step differently and float32's last
    # bits then differ).
    forward_plan: str = "tokens"

    @property
    def cache_dir(self) -> Path:
        if self.compile_cache_dir:
            return Path(self.compile_cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "vllm_accel" / "compile"


_ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "hpu", "cuda"),
    "compile_backend": ("auto", "eager", "inductor", "hpu_backend"),
    "async_scheduling": ("auto", "on", "off"),
    "bucket_graphs": ("auto", "per_bucket", "shared"),
    "forward_plan": ("tokens", "measured"),
}

_DESCRIPTIONS: dict[str, str] = {
    "kvcache_space": "KV cache size in GiB (a number > 0)",
    "num_threads": "worker torch threads (an integer >= 0, 0 = torch default)",
    "skip_warmup": "true or false",
    "cuda_graphs": "true or false",
    "cpu_kernels": "true or false",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_var_name(key: str) -> str:
    return GAUDI_ENV_NAMES.get(key, ENV_PREFIX + key.upper())


@functools.cache
def known_env_vars() -> frozenset[str]:
    return frozenset(env_var_name(f.name) for f in fields(AccelSettings))


def _parse(key: str, raw: Any, source: str) -> Any:
    field_type = {f.name: f.type for f in fields(AccelSettings)}[key]
    allowed = _ALLOWED_VALUES.get(key)
    value: Any = None
    try:
        if field_type == "float":
            value = float(raw)
            ok = value > 0
        elif field_type == "int":
            value = int(raw)
            ok = value >= 0
        elif field_type == "bool":
            text = str(raw).strip().lower()
            value, ok = text in _TRUE, text in _TRUE + _FALSE
        else:
            value = str(raw).strip()
            if allowed is not None:
                value = value.lower()
            ok = allowed is None or value in allowed
    except (TypeError, ValueError):
        ok = False
    if key in ("token_buckets", "context_buckets", "multimodal_buckets") and ok and value:
        try:
            parse_bucket_spec(value)
        except ValueError as error:
            raise ValueError(f"Invalid value {raw!r} for {source}: {error}") from None
    if not ok:
        hint = f"one of {', '.join(allowed)}" if allowed else _DESCRIPTIONS[key]
        raise ValueError(f"Invalid value {raw!r} for {source}: expected {hint}.")
    return value


def load_settings(additional_config: dict | None = None) -> AccelSettings:
    """Read the settings from the environment and vLLM's additional config.

    Parsed once per distinct input: the platform, the worker and the device
    name all ask, and get the same object."""
    known = known_env_vars()
    env = tuple(sorted((k, os.environ[k]) for k in known if k in os.environ))
    overrides = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    return _parse_settings(env, json.dumps(overrides, sort_keys=True, default=str))


@functools.lru_cache(maxsize=16)
def _parse_settings(env: tuple[tuple[str, str], ...], overrides_json: str) -> AccelSettings:
    environ = dict(env)
    values: dict[str, Any] = {}
    for f in fields(AccelSettings):
        env_name = env_var_name(f.name)
        if environ.get(env_name, "") != "":
            values[f.name] = _parse(f.name, environ[env_name], env_name)

    overrides = json.loads(overrides_json) or {}
    if not isinstance(overrides, dict):
        raise ValueError(
            f"--additional-config key '{ADDITIONAL_CONFIG_KEY}' must be a JSON object."
        )
    known = {f.name for f in fields(AccelSettings)}
    for key, raw in overrides.items():
        if key not in known:
            raise ValueError(
                f"Unknown vllm-accel setting '{key}' in --additional-config; "
                f"known settings: {', '.join(sorted(known))}."
            )
        values[key] = _parse(key, raw, f"--additional-config {ADDITIONAL_CONFIG_KEY}.{key}")
    return dataclasses.replace(AccelSettings(), **values)


def resolve_device(settings: AccelSettings) -> str:
    """The device backend in use: "cpu", "hpu" or "cuda"."""
    if settings.device != "auto":
        return settings.device
    return "hpu" if _habana_importable() else "cpu"


@functools.cache
def _habana_importable() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None
