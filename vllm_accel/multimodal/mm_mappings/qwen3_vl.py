"""Qwen3-VL (dense) on our FMS port (vllm_accel/model/qwen3_vl.py).

Images arrive from vLLM as for Qwen2.5-VL (flat patches ``pixel_values``
[patches, 3 * 2 * 16 * 16] and ``image_grid_thw``), the prompt holds one
``<|image_pad|>`` per 2x2 merged patches, positions are M-RoPE's computed
the same way, and vision buckets count patches: the Qwen2.5-VL adapter's
machinery, which this one inherits.

What differs: the tower attends within each frame in every block (no
windows: one graph per bucket; Qwen2.5-VL's bound on rows a call packs,
set by its full-attention blocks, holds), and each image token's row carries its
DeepStack features after its embedding (``layer_additions``): the decoder
adds them to its hidden states after its first layers at the image
positions, as HF's Qwen3VLTextModel does.
"""

from __future__ import annotations

from torch import nn

from vllm_accel.multimodal.mm_mappings.qwen2_5_vl import Qwen2_5_VLVisionAdapter


class Qwen3VLVisionAdapter(Qwen2_5_VLVisionAdapter):
    vision_graphs_per_bucket = 1  # every block attends within frames

    def __init__(self, model_config, fms_model: nn.Module):
        super().__init__(model_config, fms_model)
        self.layer_additions = len(fms_model.config.vision_config.deepstack_indexes)

