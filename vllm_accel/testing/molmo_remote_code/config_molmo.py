"""MolmoConfig for the tiny offline Molmo fixture (trust_remote_code).

Written for vllm-accel's test fixture, not taken from the hub: it carries the
fields of the hub's Molmo config.json that vLLM's MolmoForCausalLM reads
(hidden_size, heads, embedding_size, qkv_bias, norm_after, ...) and keeps
anything else from config.json as plain attributes (e.g. the fixture-only
``vision_backbone_config``).
"""

from transformers import PretrainedConfig


class MolmoConfig(PretrainedConfig):
    model_type = "molmo"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size=50304,
        embedding_size=50304,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        max_position_embeddings=2048,
        initializer_range=0.02,
        use_cache=True,
        layer_norm_eps=1e-5,
        rope_theta=10000.0,
        clip_qkv=None,
        qkv_bias=False,
        weight_tying=False,
        use_position_ids=True,
        tie_word_embeddings=True,
        attention_layer_norm=False,
        norm_after=False,
        layer_norm_type="rms",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.layer_norm_eps = layer_norm_eps
        self.rope_theta = rope_theta
        self.clip_qkv = clip_qkv
        self.qkv_bias = qkv_bias
        self.weight_tying = weight_tying
        self.use_position_ids = use_position_ids
        self.attention_layer_norm = attention_layer_norm
        self.norm_after = norm_after
        self.layer_norm_type = layer_norm_type
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


MolmoConfig.register_for_auto_class()
