"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa) through FMS's RoBERTa.

FMS builds BERT and RoBERTa as one class (``fms/models/roberta.py``); its
HF adapters load ``Bert*`` and ``Roberta*`` checkpoints. ``load_fms_encoder``
loads a checkpoint of an encoder entry of ``architectures.py`` with them: an
embedder's headless checkpoint (``BertModel``: keys without the ``bert.``
prefix) through an adapter that adds the prefix first, a classifier
(``*ForSequenceClassification``) as FMS's classification model.

``FmsEncoder`` runs a step's requests packed in one sequence, as the
decoders do, with bidirectional attention kept within each request (span
attention, ``ranges``) and no KV cache: every request is a whole prompt
(vLLM schedules encoder-only models without chunked prefill). FMS's own
embedding stage numbers positions from the call's first token; ours numbers
them per request, then FMS's blocks run, compiled per token bucket.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_accel.kernels import span_attention
from vllm_accel.model.compile import BucketAxis, compile_shared_forward
from vllm_accel.model.saved_graphs import SavedGraphs

# Our FMS adapter source for headless checkpoints (registered once).
_HEADLESS_SOURCE = "vllm_accel_headless"
_registered: set[str] = set()


def _register_headless_source(family: str) -> None:
    """``family``'s HF adapter, after prefixing a headless checkpoint's keys
    with ``family.`` (what FMS's renames expect)."""
    if family in _registered:
        return
    from fms.utils import serialization

    prefix = family + "."

    def add_prefix(state_dict, **_):
        return {k if k.startswith(prefix) else prefix + k: v for k, v in state_dict.items()}

    serialization.register_adapter_step(family, "vllm_accel_add_prefix", add_prefix)
    serialization.register_adapter(family, _HEADLESS_SOURCE,
                                   ["vllm_accel_add_prefix", "hf_to_fms_names", "weight_fusion"])
    _registered.add(family)


def load_fms_encoder(model_path: str, hf_config, family: str, dtype: torch.dtype,
                     device: str = "cpu") -> FmsEncoder:
    """The encoder of an HF checkpoint directory; ``family`` is FMS's model
    ("bert" or "roberta", as the architecture table names it)."""
    from fms.models import get_model
    from fms.models.hf.config_utils import param_builders

    from vllm_accel.model.fms_causal_lm import check_all_weights_loaded
    from vllm_accel.patches import nan_for_unloaded_weights

    classify = hf_config.architectures[0].endswith("ForSequenceClassification")
    build = {"bert": param_builders.build_bert_params,
             "roberta": param_builders.build_roberta_params}[family]
    params = build(hf_config, is_classify=classify)
    if classify:
        source = "hf"
    else:
        _register_headless_source(family)
        source = _HEADLESS_SOURCE
    with nan_for_unloaded_weights():
        model = get_model(family + ("_classification" if classify else ""), "base",
                          model_path=model_path, source=source, device_type=device,
                          data_type=dtype, **params)
    # An embedder's checkpoint has no masked-LM head: only the encoder must load.
    check_all_weights_loaded(model if classify else model.base_model, model_path)
    head = model.classification_head if classify else None
    return FmsEncoder(model.base_model, family, hf_config, head).eval()


class FmsEncoder(nn.Module):
    """forward(token ids, positions within each request, token types, each
    token's span of keys [first, end)) -> hidden states [1, tokens, hidden].
    ``classify``: the classification head on pooled states (classifiers)."""

    def __init__(self, headless: nn.Module, family: str, hf_config,
                 classification_head: nn.Module | None):
        super().__init__()
        self.headless = headless
        config = headless.config
        self.hidden_size: int = config.emb_dim
        self.num_layers: int = config.nlayers
        # RoBERTa numbers positions from padding_idx + 1; FMS's adapter drops
        # the table's first two rows (HF's rows 0 and 1).
        self.position_offset = hf_config.pad_token_id - 1 if family == "roberta" else 0
        # The positions the table holds (a prompt may use no more).
        self.max_positions: int = config.max_pos - self.position_offset
        self.attn_name = span_attention.register_fms_attention()
        self.classification_head = classification_head
        if classification_head is not None:
            classification_head.do_pooling = False  # vLLM's pooler picks the token

    def compile_layers(self, backend: str, buckets: list[int],
                       saved: SavedGraphs | None = None, shared: bool = False) -> None:
        """One compiled block graph per token bucket, shared by all blocks."""
        axis = BucketAxis((("x", -2), ("ranges", -2)), max(buckets)) if shared else None
        compile_shared_forward(list(self.headless.layers), backend, len(buckets), saved, axis)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
        model = self.headless
        x = (model.embedding(input_ids)
             + model.position_embedding(positions + self.position_offset)
             + model.token_type_embeddings(token_types))
        x = model.enc_norm(x)
        for layer in model.layers:
            x = layer(x, attn_name=self.attn_name, ranges=ranges)
        return x

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states [requests, hidden] -> class logits [requests, labels]."""
        return self.classification_head(pooled.to(self.headless.embedding.weight.dtype))
