"""Tiny pooling checkpoints (embedders, classifiers, a cross-encoder), made
offline and deterministically with transformers' own classes.

Each is a sentence-transformers checkpoint where it embeds: ``modules.json``
with its ``1_Pooling`` (and ``2_Normalize`` where it normalizes), which vLLM
reads into its pooler config. The encoders share the tiny byte-level
tokenizer of the text fixtures, with a BERT-style template: ``<bos>`` opens a
sequence as [CLS] does, ``<eos>`` closes each segment as [SEP] does, and the
second segment of a pair has token type 1.

- ``bert``: ``BertModel``, mean pooling, normalized, matryoshka dimensions.
- ``roberta``: ``RobertaModel``, CLS pooling (positions from ``padding_idx + 1``).
- ``bert_classifier``: ``BertForSequenceClassification``, 3 labels.
- ``cross_encoder``: ``BertForSequenceClassification``, 1 label (a score).
- ``qwen3_embedder``: the tiny Qwen3, last-token pooling, normalized.
- ``mpnet``: ``MPNetModel``'s weights under ``MPNetForMaskedLM`` (as
  sentence-transformers publish MPNet embedders), mean pooling, normalized.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from vllm_accel.testing.tiny_models import (BOS, EOS, WEIGHT_STD, _save_tokenizer,
                                            build_tokenizer, make_tiny_checkpoint)

ENCODERS = ("bert", "roberta", "bert_classifier", "cross_encoder", "qwen3_embedder", "mpnet")
ENCODER_HIDDEN = 64
ENCODER_LAYERS = 2
ENCODER_HEADS = 4
ENCODER_INTERMEDIATE = 128
ENCODER_MAX_POS = 512
CLASSIFIER_LABELS = 3
MATRYOSHKA_DIMENSIONS = (16, 32, ENCODER_HIDDEN)
# Which sentence-transformers pooling each embedder declares.
_POOLING = {"bert": "mean", "roberta": "cls", "qwen3_embedder": "lasttoken", "mpnet": "mean"}
_NORMALIZED = {"bert", "qwen3_embedder", "mpnet"}
SEED_OFFSET = 86_028_121  # their own weights, apart from the other fixtures'


def encoder_tokenizer():
    """The tiny tokenizer, templated as BERT's: <bos> A <eos> [B <eos>, type 1]."""
    from tokenizers import processors

    tokenizer = build_tokenizer()
    bos, eos = tokenizer.convert_tokens_to_ids([BOS, EOS])
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B:1 {EOS}:1",
        special_tokens=[(BOS, bos), (EOS, eos)])
    return tokenizer


def _encoder_config(kind: str, tokenizer):
    from transformers import BertConfig, MPNetConfig, RobertaConfig

    common = dict(
        vocab_size=len(tokenizer), hidden_size=ENCODER_HIDDEN,
        num_hidden_layers=ENCODER_LAYERS, num_attention_heads=ENCODER_HEADS,
        intermediate_size=ENCODER_INTERMEDIATE, hidden_act="gelu", type_vocab_size=2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, dtype="float32")
    if kind == "roberta":
        # Positions start at padding_idx + 1: the table holds that many more rows.
        pad = tokenizer.pad_token_id
        config = RobertaConfig(max_position_embeddings=ENCODER_MAX_POS + pad + 1,
                               layer_norm_eps=1e-5, **common)
        config.architectures = ["RobertaModel"]
        return config
    if kind == "mpnet":  # positions from HF's fixed padding_idx 1, plus one
        common.pop("type_vocab_size")
        config = MPNetConfig(max_position_embeddings=ENCODER_MAX_POS + 2, layer_norm_eps=1e-12,
                             relative_attention_num_buckets=32, **common)
        config.architectures = ["MPNetForMaskedLM"]
        return config
    config = BertConfig(max_position_embeddings=ENCODER_MAX_POS, layer_norm_eps=1e-12, **common)
    if kind == "bert":
        config.architectures = ["BertModel"]
        # Trained so that a prefix of the embedding is one too (vLLM's dimensions).
        config.matryoshka_dimensions = list(MATRYOSHKA_DIMENSIONS)
    else:
        config.num_labels = 1 if kind == "cross_encoder" else CLASSIFIER_LABELS
        config.architectures = ["BertForSequenceClassification"]
    return config


def write_sentence_transformers(out: pathlib.Path, pooling: str, normalize: bool, hidden: int,
                                max_seq_length: int = ENCODER_MAX_POS) -> None:
    """sentence-transformers' files: ``pooling`` ("mean", "cls" or
    "lasttoken"), then Normalize if ``normalize``."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    # The longest input, as a real checkpoint's says (vLLM caps max_model_len to it).
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}) + "\n")
    (out / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
              "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
              "include_prompt": True}
    config[{"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
            "lasttoken": "pooling_mode_lasttoken"}[pooling]] = True
    (out / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tiny_encoder(kind: str, out_dir: str | os.PathLike, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny ``kind`` checkpoint (one of ``ENCODERS``) into ``out_dir``."""
    if kind not in ENCODERS:
        raise ValueError(f"unknown tiny encoder {kind!r}; choose from {ENCODERS}")
    out = pathlib.Path(out_dir)
    if kind == "qwen3_embedder":
        make_tiny_checkpoint("qwen3", out, seed=seed, printable_only=False)
        from transformers import AutoConfig

        write_sentence_transformers(out, _POOLING[kind], kind in _NORMALIZED,
                                    AutoConfig.from_pretrained(out).hidden_size)
        return out
    from transformers import BertForSequenceClassification, BertModel, MPNetModel, RobertaModel

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = encoder_tokenizer()
    config = _encoder_config(kind, tokenizer)
    model_class = {"bert": BertModel, "roberta": RobertaModel, "mpnet": MPNetModel}.get(
        kind, BertForSequenceClassification)
    g = torch.Generator().manual_seed(seed + SEED_OFFSET + ENCODERS.index(kind))
    model = (model_class(config, add_pooling_layer=False) if kind in _POOLING
             else model_class(config)).eval()
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "LayerNorm.weight" in name:
                parameter.copy_(1.0 + 0.05 * torch.randn(parameter.shape, generator=g))
            else:  # biases too: a bias left out shows
                parameter.copy_(WEIGHT_STD * torch.randn(parameter.shape, generator=g))
    model.save_pretrained(out)
    _save_tokenizer(tokenizer, out, tokenizer.chat_template)
    # Pairs carry token types (the tokenizer returns them only when asked).
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(model_input_names=["input_ids", "token_type_ids", "attention_mask"],
              model_max_length=ENCODER_MAX_POS)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    if kind in _POOLING:
        write_sentence_transformers(out, _POOLING[kind], kind in _NORMALIZED, ENCODER_HIDDEN)
    return out
