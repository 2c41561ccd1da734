"""vllm-accel: a vLLM platform plugin that runs IBM FMS models on a
compile-centric accelerator backend (a CPU simulation, or Gaudi when present).

Importing this package has no side effects: vLLM calls ``register`` through the
``vllm.platform_plugins`` entry point (``VLLM_PLUGINS=accel`` selects it).
"""

PLATFORM_CLASS = "vllm_accel.platform.AccelPlatform"


def register() -> str:
    """Entry point for ``vllm.platform_plugins``: the platform's dotted path."""
    return PLATFORM_CLASS


def register_general() -> None:
    """Entry point for ``vllm.general_plugins``: runs once in every vLLM process."""
    from vllm_accel.model.vllm_registry import register_with_vllm
    from vllm_accel.patches import apply_patches

    apply_patches()
    register_with_vllm()
