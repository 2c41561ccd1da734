"""One logger helper, so every module logs inside vLLM's logger tree."""

from __future__ import annotations

import logging


def get_logger(module_name: str) -> logging.Logger:
    """A child of the "vllm" logger: same handler, format and
    VLLM_LOGGING_LEVEL as vLLM's own lines (a logger outside that tree has no
    handler, and its INFO lines are dropped)."""
    from vllm.logger import init_logger

    return init_logger(f"vllm.{module_name}")
