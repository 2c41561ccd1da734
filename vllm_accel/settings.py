"""All vllm-accel settings, in one typed place.

Each setting can come from an environment variable (``VLLM_ACCEL_*``) or from
vLLM's ``--additional-config '{"accel": {"<key>": ...}}'``; the additional
config wins because it is the more explicit of the two. An invalid value fails
at start-up with a message naming the variable and the allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, fields
from typing import Any

ENV_PREFIX = "VLLM_ACCEL_"
ADDITIONAL_CONFIG_KEY = "accel"


@dataclass(frozen=True)
class AccelSettings:
    # Memory for the paged KV cache, in GiB (like vLLM CPU's VLLM_CPU_KVCACHE_SPACE).
    kvcache_space: float = 4.0
    # Which device runs the model: "auto" picks "hpu" when habana_frameworks is
    # importable, else the CPU simulated accelerator.
    device: str = "auto"
    # Threads the worker's torch ops may use; 0 leaves torch's default.
    num_threads: int = 0


_ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "hpu"),
}

_DESCRIPTIONS: dict[str, str] = {
    "kvcache_space": "KV cache size in GiB (a number > 0)",
    "device": "device backend",
    "num_threads": "worker torch threads (an integer >= 0, 0 = torch default)",
}


def env_var_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def known_env_vars() -> set[str]:
    return {env_var_name(f.name) for f in fields(AccelSettings)}


def _parse(key: str, raw: Any, source: str) -> Any:
    field_type = {f.name: f.type for f in fields(AccelSettings)}[key]
    allowed = _ALLOWED_VALUES.get(key)
    try:
        if field_type == "float":
            value: Any = float(raw)
            ok = value > 0
        elif field_type == "int":
            value = int(raw)
            ok = value >= 0
        else:
            value = str(raw).strip().lower()
            ok = allowed is None or value in allowed
    except (TypeError, ValueError):
        ok = False
    if not ok:
        hint = f"one of {', '.join(allowed)}" if allowed else _DESCRIPTIONS[key]
        raise ValueError(f"Invalid value {raw!r} for {source}: expected {hint}.")
    return value


def load_settings(additional_config: dict | None = None) -> AccelSettings:
    """Read the settings from the environment and vLLM's additional config."""
    values: dict[str, Any] = {}
    for f in fields(AccelSettings):
        env_name = env_var_name(f.name)
        if os.environ.get(env_name, "") != "":
            values[f.name] = _parse(f.name, os.environ[env_name], env_name)

    overrides = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
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
    """The device backend in use: "hpu" or "cpu"."""
    if settings.device != "auto":
        return settings.device
    return "hpu" if importlib.util.find_spec("habana_frameworks") else "cpu"
