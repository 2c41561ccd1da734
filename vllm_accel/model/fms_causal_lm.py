"""One generic wrapper around IBM foundation-model-stack (FMS) causal LMs.

``load_fms_model`` loads any HF checkpoint directory of an architecture in
``vllm_accel/architectures.py`` (registering our port first when FMS lacks the
model) and checks that every weight was really loaded (FMS only logs keys it
cannot place). ``FmsCausalLM`` wraps the text model (for a vision-language
model, the language model its vision adapter names), compiles its decoder
layers, and exposes the two calls the runner needs: ``forward`` (token ids or
embeddings and positions -> hidden states; the paged-KV layout comes from
``attention_context``) and ``compute_logits``.
"""

from __future__ import annotations

import inspect

import torch
from fms.modules.attention import MultiHeadAttention
from fms.modules.tp import TPModule
from torch import nn

from vllm_accel.architectures import find_architecture, load_object
from vllm_accel.forward_context import get_forward_context
from vllm_accel.log import get_logger
from vllm_accel.model.compile import BucketAxis, compile_shared_forward
from vllm_accel.model.mamba2 import PagedMamba2, recurrent_mixers
from vllm_accel.model.saved_graphs import SavedGraphs
from vllm_accel.model.paged_attention import ATTN_NAME, register_paged_attention
from vllm_accel.model.ports import register_port
from vllm_accel.patches import nan_for_unloaded_weights

logger = get_logger(__name__)


def load_fms_model(model_path: str, hf_config, dtype: torch.dtype,
                   device: str = "cpu", trust_remote_code: bool = False,
                   tp_group=None) -> nn.Module:
    """The FMS model of a supported HF checkpoint directory, every weight loaded.
    ``trust_remote_code``: the user's consent (vLLM's option), needed for
    checkpoints whose config is remote code (Molmo).

    With ``tp_group`` (a torch.distributed process group of more than one
    rank), FMS loads this rank's shard: ``get_model(distributed_strategy="tp",
    group=tp_group)`` builds the model with FMS's ``TensorParallelStrategy``,
    whose layers hold a slice of the heads and MLP and all-reduce their output
    over the group."""
    arch = find_architecture(hf_config.architectures)
    tp_size = tp_group.size() if tp_group is not None else 1
    if tp_size > 1 and not arch.tensor_parallel:
        raise ValueError(f"vllm-accel cannot shard {arch.name} for tensor parallelism.")
    if arch.fms_port is not None:
        register_port(load_object(arch.fms_port))
    register_paged_attention()
    extra = {}
    if arch.remote_code:
        if not trust_remote_code:
            raise ValueError(f"{arch.name} checkpoints ship their config as remote code: "
                             "pass trust_remote_code=True (--trust-remote-code)")
        extra["trust_remote_code"] = True
    if tp_size > 1:
        extra.update(distributed_strategy="tp", group=tp_group)
    extra.update(arch.fms_config_overrides(hf_config))
    model = _load_with_nan_fill(model_path, dtype, device, **extra)
    check_all_weights_loaded(model, model_path)
    if arch.paged_layers is not None:
        load_object(arch.paged_layers)(model)
    logger.info(
        "Loaded %s with FMS (%.1fM parameters%s, %s)",
        type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6,
        f" on this rank of {tp_size}" if tp_size > 1 else "", dtype,
    )
    return model.eval()


def _load_with_nan_fill(model_path: str, dtype: torch.dtype, device: str,
                        **kwargs) -> nn.Module:
    """Load with FMS, leaving any weight FMS did not load as NaN (not garbage):
    FMS builds the model on the meta device and materialises unloaded weights
    with ``torch.empty_like``."""
    from fms.models import get_model

    with nan_for_unloaded_weights():
        return get_model(
            "hf_pretrained", model_path=model_path, device_type=device, data_type=dtype,
            **kwargs,
        )


def check_all_weights_loaded(model: nn.Module, model_path: str) -> None:
    missing = [
        name
        for name, param in model.named_parameters()
        if param.is_floating_point() and torch.isnan(param).any()
    ]
    if missing:
        shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ValueError(
            f"{len(missing)} model weights were not loaded from the checkpoint in "
            f"{model_path} (missing or misnamed keys): {shown}"
        )


class FmsCausalLM(nn.Module):
    """An FMS decoder-only text model driven through vLLM's paged KV cache."""

    def __init__(self, fms_model: nn.Module):
        super().__init__()
        self.fms_model = fms_model
        config = fms_model.config
        self.num_layers: int = config.nlayers
        # Layers that keep recurrent state (Mamba2) instead of keys and values.
        self.recurrent: dict[int, PagedMamba2] = recurrent_mixers(fms_model)
        # This rank's KV heads: all of them, or its shard under tensor
        # parallelism (FMS gives each rank kvheads / tp, at least one).
        attn = next(m for m in fms_model.base_model.layers.modules()
                    if isinstance(m, MultiHeadAttention))
        self.num_kv_heads: int = attn.kvheads
        self.num_heads: int = attn.nheads  # this rank's query heads
        # A head's width as the attention computes it (not always hidden / heads).
        self.head_dim: int = attn.emb_kq_per_head
        self.hidden_size: int = getattr(config, "emb_dim", None) or config.dim  # FMS names vary
        # FMS shards the head for some architectures (a TP module), not for these.
        self.head_replicated: bool = not isinstance(fms_model.head, TPModule)
        # The logits' columns: the head's rows (Molmo's exceed vocab_size).
        self.logits_width: int = fms_model.head.out_features
        # Granite divides its logits by this; other models have no such field.
        self.logits_scaling: float = float(getattr(config, "logits_scaling", 1.0))

    def compile_layers(self, backend: str, buckets: list[int],
                       saved: SavedGraphs | None = None, shared: bool = False) -> None:
        """One compiled decoder-layer graph per token bucket, shared by all
        layers, and one of the final norm; ``shared``: one for bucket 1 and
        one for all the others."""
        # A decoder layer's hidden states are [1, tokens, hidden], its
        # positions [1, tokens] ([3, 1, tokens] with M-RoPE), its KV cache
        # slots [tokens] where the layers store keys/values (see forward).
        axis = (BucketAxis((("x", -2), ("position_ids", -1), ("kv_slots", 0)), max(buckets))
                if shared else None)
        # Layers of one class share a compiled function (a hybrid model's
        # attention and Mamba2 blocks are two stacks).
        stacks: dict[type, list[nn.Module]] = {}
        for layer in self.fms_model.base_model.layers:
            stacks.setdefault(type(layer), []).append(layer)
        for layers in stacks.values():
            compile_shared_forward(layers, backend, len(buckets), saved, axis)
        # Eager, the final norm is several small kernels a step (eight on
        # the GPU); compiled, one. Its input is FMS's norm's ``x`` or
        # torch's LayerNorm's ``input`` (GPT-BigCode): named by its forward.
        norm = self.fms_model.base_model.dec_norm
        hidden = list(inspect.signature(norm.forward).parameters)[0]
        norm_axis = BucketAxis(((hidden, -2),), max(buckets)) if shared else None
        compile_shared_forward([norm], backend, len(buckets), saved, norm_axis)

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> torch.Tensor:
        """inputs: token ids [1, tokens] (or embeddings [1, tokens, hidden],
        for FMS models that take them); kv_caches: per layer, its keys and
        values, or (a recurrent layer) its state's pages and group. Returns
        hidden states [1, tokens, hidden]."""
        # Where the layout lets them, the layers store the keys/values in
        # their own graphs (the slot mapping as an attention argument). Only
        # forwards of one layout: with several (KV cache groups), each group
        # has its own slots, and a layer's group is known inside the op alone.
        layouts = get_forward_context().attention
        store = ({"kv_slots": layouts[0].slot_mapping}
                 if layouts and len(layouts) == 1 and layouts[0].stored_by_layers else {})
        hidden, _ = self.fms_model.base_model(
            inputs,
            position_ids=positions,
            past_key_value_states=kv_caches,
            use_cache=True,
            attn_name=ATTN_NAME,
            **store,
        )
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.fms_model.head(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float()
