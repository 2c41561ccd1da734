"""Runtime shims that let vLLM and transformers process vision inputs without
torchvision (which has no CPU build on the registry). Installed in every vLLM
process through our ``vllm.general_plugins`` entry point."""


def install_shims() -> None:
    """Idempotent; does nothing until a vision architecture needs it."""
