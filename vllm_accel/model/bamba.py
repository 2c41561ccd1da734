"""FMS's Bamba with its Mamba2 layers over vLLM's paged recurrent state.

FMS's ``BambaBlock`` runs its Mamba2 mixer (``fms.modules.ssm.SSM``) on an
``SSMCacheUnit`` it mutates (a per-batch state object, its offset counted in
Python), which neither continues a state across prefill chunks nor keeps
several requests' states apart in one packed sequence. ``page_recurrent_layers``
swaps each Mamba2 block of a loaded model for a ``Mamba2Block``: the same
weights and arithmetic (pre-norm, mixer, residual, pre-norm, gated MLP,
residual), the mixer a ``PagedMamba2``. Attention blocks stay FMS's own.
"""

from __future__ import annotations

from torch import nn

from vllm_accel.model.mamba2 import Mamba2Block, PagedMamba2


def page_recurrent_layers(model: nn.Module) -> int:
    """Swap the Mamba2 blocks of a loaded FMS Bamba for ``Mamba2Block``s;
    returns how many."""
    layers = model.base_model.layers
    swapped = 0
    for index, block in enumerate(layers):
        if getattr(block, "is_mamba_layer", False):
            layers[index] = Mamba2Block(block.ln, PagedMamba2(block.ssm), block.ff_ln,
                                        block.ff_sub_layer)
            swapped += 1
    return swapped
