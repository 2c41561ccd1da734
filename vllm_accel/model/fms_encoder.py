"""Encoder-only models through FMS: BERT, RoBERTa and XLM-RoBERTa through
FMS's RoBERTa, MPNet through FMS's MPNet.

FMS builds BERT and RoBERTa as one class (``fms/models/roberta.py``); its
HF adapters load ``Bert*`` and ``Roberta*`` checkpoints. ``load_fms_encoder``
loads a checkpoint of an encoder entry of ``architectures.py`` with them: an
embedder's headless checkpoint (``BertModel``: keys without the ``bert.``
prefix) through an adapter that adds the prefix first, a classifier
(``*ForSequenceClassification``) as FMS's classification model. FMS's MPNet
adapter reads headless keys (what sentence-transformers publish); a
checkpoint with an ``mpnet.`` prefix has it dropped first.

``FmsEncoder`` runs a step's requests packed in one sequence, as the
decoders do, with bidirectional attention kept within each request (span
attention, ``ranges``) and no KV cache: every request is a whole prompt
(vLLM schedules encoder-only models without chunked prefill). FMS's own
embedding stage numbers positions from the call's first token; ours numbers
them per request, then FMS's blocks run, compiled per token bucket.
``FmsMpnetEncoder`` adds MPNet's relative position bias to attention scores
(SDPA's float mask, as FMS's MPNet passes it, -inf outside each request's span).
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
    """``family``'s HF adapter, after giving a checkpoint's keys the form
    FMS's renames expect: prefixed with ``family.`` (BERT, RoBERTa), or
    without the ``mpnet.`` prefix (MPNet)."""
    if family in _registered:
        return
    from fms.utils import serialization

    prefix = family + "."

    def add_prefix(state_dict, **_):
        return {k if k.startswith(prefix) else prefix + k: v for k, v in state_dict.items()}

    def drop_prefix(state_dict, **_):
        return {k.removeprefix(prefix): v for k, v in state_dict.items()}

    serialization.register_adapter_step(family, "vllm_accel_key_prefix",
                                        drop_prefix if family == "mpnet" else add_prefix)
    serialization.register_adapter(family, _HEADLESS_SOURCE,
                                   ["vllm_accel_key_prefix", "hf_to_fms_names", "weight_fusion"])
    _registered.add(family)


def load_fms_encoder(model_path: str, hf_config, family: str, dtype: torch.dtype,
                     device: str = "cpu") -> FmsEncoder:
    """The encoder of an HF checkpoint directory; ``family`` is FMS's model
    ("bert", "roberta" or "mpnet", as the architecture table names it)."""
    from fms.models import get_model
    from fms.models.hf.config_utils import param_builders

    from vllm_accel.model.fms_causal_lm import check_all_weights_loaded
    from vllm_accel.patches import nan_for_unloaded_weights

    classify = hf_config.architectures[0].endswith("ForSequenceClassification")
    if family == "mpnet":
        params, variant = param_builders.build_mpnet_params(hf_config), "v2"
    else:
        build = {"bert": param_builders.build_bert_params,
                 "roberta": param_builders.build_roberta_params}[family]
        params, variant = build(hf_config, is_classify=classify), "base"
    if classify:
        source = "hf"
    else:
        _register_headless_source(family)
        source = _HEADLESS_SOURCE
    with nan_for_unloaded_weights():
        model = get_model(family + ("_classification" if classify else ""), variant,
                          model_path=model_path, source=source, device_type=device,
                          data_type=dtype, **params)
    # An embedder's checkpoint has no masked-LM head: only the encoder must load.
    check_all_weights_loaded(model if classify else model.base_model, model_path)
    if family == "mpnet":
        return FmsMpnetEncoder(model.base_model).eval()
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
        # RoBERTa numbers positions from padding_idx + 1; FMS's adapter drops
        # the table's first two rows (HF's rows 0 and 1).
        self.position_offset = hf_config.pad_token_id - 1 if family == "roberta" else 0
        self.attn_name = span_attention.register_fms_attention()
        self.classification_head = classification_head
        if classification_head is not None:
            classification_head.do_pooling = False  # vLLM's pooler picks the token

    def compile_layers(self, backend: str, buckets: list[int],
                       saved: SavedGraphs | None = None, shared: bool = False) -> None:
        """One compiled block graph per token bucket, shared by all blocks."""
        axis = BucketAxis(self.bucket_dims, max(buckets)) if shared else None
        compile_shared_forward(list(self.headless.layers), backend, len(buckets), saved, axis)

    # The blocks' arguments whose dimension is the bucket's token count.
    bucket_dims = (("x", -2), ("ranges", -2))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids, positions, token_types)
        attention = self.attention(ranges)
        for layer in self.headless.layers:
            x = layer(x, **attention)
        return x

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor,
              token_types: torch.Tensor) -> torch.Tensor:
        model = self.headless
        x = (model.embedding(input_ids)
             + model.position_embedding(positions + self.position_offset)
             + model.token_type_embeddings(token_types))
        return model.enc_norm(x)

    def attention(self, ranges: torch.Tensor) -> dict:
        """The blocks' attention arguments: each token attends to its span
        (``ranges`` [blocks, tokens a block, 2]: the forward's tokens in
        blocks of whole prompts, spans within their block). On the cpu, in
        one block, by the spans (the span kernel, or SDPA span by span);
        else by one mask a block, built once a forward: one SDPA launch a
        layer, no spans read back to the host, no work across blocks."""
        if ranges.device.type == "cpu" and ranges.shape[0] == 1:
            return {"attn_name": self.attn_name, "ranges": ranges}
        return self.masked_attention(ranges)

    def masked_attention(self, ranges: torch.Tensor) -> dict:
        """``attention`` by one mask a block (a GPU's)."""
        return {"attn_name": self.attn_name,
                "block_mask": span_attention.span_mask(ranges, ranges.shape[1])}

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states [requests, hidden] -> class logits [requests, labels]."""
        return self.classification_head(pooled.to(self.headless.embedding.weight.dtype))


class FmsMpnetEncoder(FmsEncoder):
    """MPNet: no token types, positions from HF's fixed ``padding_idx`` 1
    plus one, and a learned bias per head and relative-position bucket
    (FMS's ``relative_position_bucket``) added to attention scores."""

    bucket_dims = (("x", -2), ("position_bias", -2), ("position_bias", -1))
    POSITION_OFFSET = 2  # HF's MPNetEmbeddings: padding_idx = 1, whatever the config says

    def __init__(self, headless: nn.Module):
        nn.Module.__init__(self)
        self.headless = headless
        self.attn_name = span_attention.register_fms_attention()
        self.classification_head = None
        # tokens -> [tokens, tokens] bucket of each (query, key) distance
        self._distance_buckets: dict[int, torch.Tensor] = {}

    def embed(self, input_ids, positions, token_types):
        model = self.headless
        x = model.word_embedding(input_ids) + model.position_embeddings(
            positions + self.POSITION_OFFSET)
        return model.enc_norm(x)

    def attention(self, ranges: torch.Tensor) -> dict:
        """The position bias [blocks, heads, tokens, tokens] within each
        token's span, -inf outside it (the blocks' attention adds it to the
        scores)."""
        tokens = ranges.shape[1]
        buckets = self._distance_buckets.get(tokens)
        if buckets is None:
            index = torch.arange(tokens, device=ranges.device)
            buckets = self.headless.relative_position_bucket(
                index[None, :] - index[:, None],
                num_buckets=self.headless.config.relative_attention_num_buckets)
            self._distance_buckets[tokens] = buckets
        bias = self.headless.relative_attention_bias(buckets).permute(2, 0, 1)
        outside = ~span_attention.span_mask(ranges, tokens)
        mask = torch.where(outside, float("-inf"), bias)
        return {"attn_name": self.attn_name, "position_bias": mask.contiguous()}
