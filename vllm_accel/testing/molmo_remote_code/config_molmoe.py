"""MolmoConfig for the tiny offline MolmoE fixture (trust_remote_code).

Written for vllm-accel's test fixture, not taken from the hub: like the hub's
config_molmoe.py it takes MolmoE's config.json with OLMo's keys (d_model,
n_heads, n_layers, moe_num_experts, ...) as attributes, says model_type
"molmo" and answers hidden_size, num_attention_heads and num_hidden_layers
(what vLLM reads) from them.
"""

from transformers import PretrainedConfig


class MolmoConfig(PretrainedConfig):
    model_type = "molmo"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, d_model=2048, n_heads=16, n_kv_heads=None, n_layers=16,
                 use_cache=True, **kwargs):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.use_cache = use_cache
        kwargs.setdefault("architectures", ["OLMoForCausalLM"])
        super().__init__(**kwargs)

    @property
    def num_attention_heads(self):
        return self.n_heads

    @property
    def num_hidden_layers(self):
        return self.n_layers

    @property
    def hidden_size(self):
        return self.d_model


MolmoConfig.register_for_auto_class()
