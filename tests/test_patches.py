"""Process-wide patches (vllm_accel/patches.py) that leave the caller's state
as they found it, and the stand-in video processor's pickling."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.utils import deterministic

from vllm_accel.patches import nan_for_unloaded_weights, torchvision_available, use_v1_model_runner


@pytest.fixture
def restore_deterministic_mode():
    state = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    deterministic.fill_uninitialized_memory = state[2]


@pytest.mark.parametrize("enabled, warn_only", [(True, True), (True, False), (False, False)])
def test_nan_for_unloaded_weights_restores_deterministic_mode(
        restore_deterministic_mode, enabled, warn_only):
    """Patch 8 restores the caller's mode, warn_only included."""
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    with nan_for_unloaded_weights():
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.empty(4).isnan().all()
    assert torch.are_deterministic_algorithms_enabled() is enabled
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only


def test_use_v1_model_runner(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    use_v1_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


@pytest.mark.skipif(torchvision_available(), reason="the stand-in is for hosts without torchvision")
def test_video_stub_pickles_from_its_module():
    from vllm_accel.video_stub import Qwen2VLVideoProcessor

    assert Qwen2VLVideoProcessor.__module__ == "vllm_accel.video_stub"
    processor = Qwen2VLVideoProcessor(max_pixels=200704)
    copy = pickle.loads(pickle.dumps(processor))
    assert type(copy) is Qwen2VLVideoProcessor
    assert copy.size["longest_edge"] == 200704 and copy.merge_size == 2
