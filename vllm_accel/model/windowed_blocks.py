"""Decoder blocks whose layers may each attend through their own window
(Granite SWA, GPT-OSS): FMS's own blocks swapped for ones the runner can drive.

FMS's blocks of these models pick or feed their attention in ways that break
the runner's one-op, shared-graph design:

- ``GraniteSWABlock`` chooses its attention op by name: it replaces the
  ``attn_name`` it is called with by ``spyre_paged_attn_with_sinks`` where the
  name holds "paged" (ours, ``vllm_accel_paged``, does: FMS has registered no
  such op) and by ``sdpa_with_sinks`` where it holds "sdpa";
- both hand their attention the layer's window as an int of its own (GPT-OSS's
  headless model passes each block's ``layer_sliding_window``), which would
  make each window a graph of its own;
- neither passes the attention the layout of the layer's KV cache group.

``page_attention_layers`` swaps every block for ``AttentionBlock``: the same
submodules and weights (pre-norm, attention with its sinks, residual scaled,
pre-norm, MLP or experts, residual scaled) and FMS's arithmetic, our op kept,
and the index of the layer's attention layout (from its KV cache entry)
passed to the op: the layout of its KV cache group and window (vLLM's hybrid
KV cache manager keeps windowed and full-attention layers in groups of their
own). FMS's attention passes the sinks itself (``MultiHeadAttention(has_sinks=True)``).
"""

from __future__ import annotations

from torch import nn


class AttentionBlock(nn.Module):
    """A pre-norm decoder block, called as FMS's headless model calls its
    blocks; ``past_key_value_state`` is the layer's KV cache entry: its keys
    and values, and its layout's index where a forward has several."""

    # Read by FMS's GPT-OSS headless model, which passes it on as the
    # ``sliding_window`` keyword; the op ignores it (a layer's window is its
    # layout's), and one value for every layer keeps one graph for them all.
    layer_sliding_window = 0

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln, self.attn = block.ln, block.attn
        self.ff_ln, self.ff_sub_layer = block.ff_ln, block.ff_sub_layer
        # Granite's residual multiplier; other configs have none (1).
        self.residual_multiplier = float(getattr(block.config, "residual_multiplier", 1.0))

    def forward(self, x, *, position_ids=None, past_key_value_state=None, use_cache=False,
                **attn_kwargs):
        keys, values, *layout = past_key_value_state
        if layout:
            attn_kwargs["attention_layout"] = layout[0]
        attended = self.attn(q=self.ln(x), position_ids=position_ids,
                             past_key_value_state=(keys, values), use_cache=use_cache,
                             **attn_kwargs)
        cache = None
        if use_cache:
            attended, cache = attended
        x = self._residual(attended, x)
        x = self._residual(self.ff_sub_layer(self.ff_ln(x)), x)
        return (x, cache) if use_cache else x

    def _residual(self, update, x):
        if self.residual_multiplier == 1.0:  # as FMS adds it (no multiply)
            return update + x
        return update * self.residual_multiplier + x


def page_attention_layers(model: nn.Module) -> int:
    """Swap the blocks of a loaded FMS model for ``AttentionBlock``s; returns how many."""
    layers = model.base_model.layers
    for index, block in enumerate(layers):
        layers[index] = AttentionBlock(block)
    return len(layers)
