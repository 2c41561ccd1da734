"""GPT-OSS's port (model/gpt_oss.py) builds FMS's config from HF's and
refuses, naming the setting, what FMS's class cannot compute (served end to
end: test_generation.py; its YaRN against HF: test_tiny_models.py)."""

from __future__ import annotations

import pytest

from vllm_accel.model.gpt_oss import gpt_oss_config_from_hf


def hf_config(**changes):
    from transformers import GptOssConfig

    fields = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, head_dim=64,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, sliding_window=24, max_position_embeddings=2048)
    return GptOssConfig(**{**fields, **changes})


def test_the_config_carries_hf_fields_fms_would_lose():
    config = gpt_oss_config_from_hf(hf_config())
    # FMS's param builder keeps its defaults for these (rope_base, ...) and
    # takes max_position_embeddings as YaRN's pre-training length.
    assert (config.rope_base, config.rope_scaling_factor) == (150000.0, 32.0)
    assert config.rope_original_max_seq_len == 4096
    assert config.max_expected_seq_len == 2048 and config.top_k_experts == 2
    assert config.layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("changes, named", [
    (dict(intermediate_size=512), "intermediate_size 512"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha 1.5"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(quantization_config={"quant_method": "mxfp4"}), "MXFP4"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                           "original_max_position_embeddings": 4096, "truncate": True}),
     "truncate False"),
])
def test_what_fms_cannot_compute_is_refused_by_name(changes, named):
    with pytest.raises(ValueError, match=named):
        gpt_oss_config_from_hf(hf_config(**changes))
