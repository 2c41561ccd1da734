"""The oracle MolmoE is checked against: transformers' own OlmoeForCausalLM
as the decoder, holding the fixture's weights renamed into OLMoE's layout,
fed the prompt's embeddings with our Molmo vision backbone's image embeddings
merged in at the ``<im_patch>`` positions (that backbone equals vLLM's Molmo:
test_molmo.py), greedy in float32. vLLM's own Molmo processing expands the
prompts, as in the engine. transformers has no MolmoE and the hub's remote
modeling code needs megablocks: nothing else could say what MolmoE computes.
"""

from __future__ import annotations

import torch
from molmo_reference import ENDOFTEXT, IM_PATCH, processed_prompt
from port_helpers import image_embeddings, load_hf_vision_weights
from safetensors.torch import load_file

from vllm_accel.model.molmo import MolmoVisionBackbone
from vllm_accel.model.molmoe import molmoe_config_from_hf


def _hf_config(ckpt):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ckpt, trust_remote_code=True)


def olmoe_state_dict(sd: dict, hf_config) -> dict:
    """The hub layout's decoder weights in OlmoeForCausalLM's: q/k/v split
    from att_proj, each layer's experts stacked (``gate_up_proj`` [experts,
    2 * width, d]: gate rows then up rows; ``down_proj`` [experts, d, width]),
    the embedding's two tables as one, the head padded with zero rows to the
    embedding's (the oracle's argmax reads only the head's own rows)."""
    t, d = "model.transformer.", hf_config.d_model
    experts = hf_config.moe_num_experts
    out = {"model.embed_tokens.weight": torch.cat([sd[t + "wte.embedding"],
                                                   sd[t + "wte.new_embedding"]]),
           "model.norm.weight": sd[t + "ln_f.weight"]}
    head = sd[t + "ff_out.weight"]
    out["lm_head.weight"] = torch.cat(
        [head, head.new_zeros(sd[t + "wte.new_embedding"].shape)])
    for i in range(hf_config.n_layers):
        p, q = f"{t}blocks.{i}.", f"model.layers.{i}."
        for name, part in zip(("q_proj", "k_proj", "v_proj"), sd[p + "att_proj.weight"].chunk(3)):
            out[f"{q}self_attn.{name}.weight"] = part
        out[q + "self_attn.o_proj.weight"] = sd[p + "attn_out.weight"]
        out[q + "self_attn.q_norm.weight"] = sd[p + "q_norm.weight"]
        out[q + "self_attn.k_norm.weight"] = sd[p + "k_norm.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attn_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ff_norm.weight"]
        out[q + "mlp.gate.weight"] = sd[p + "ffn.router.layer.weight"]
        gate, up, down = (sd[f"{p}ffn.experts.mlp.{w}"].reshape(experts, -1, d)
                          for w in ("w1", "v1", "w2"))
        out[q + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[q + "mlp.experts.down_proj"] = down.transpose(1, 2).contiguous()
    return out


def olmoe_decoder(ckpt, renormalize: bool = False):
    """OlmoeForCausalLM (float32, eval) with the checkpoint's decoder weights;
    ``renormalize``: OLMoE's norm_topk_prob (MolmoE's is false)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    hf_config = _hf_config(ckpt)
    sd = load_file(ckpt / "model.safetensors")
    rows = hf_config.embedding_size + sd["model.transformer.wte.new_embedding"].shape[0]
    config = OlmoeConfig(
        vocab_size=rows, hidden_size=hf_config.d_model, num_hidden_layers=hf_config.n_layers,
        intermediate_size=molmoe_config_from_hf(hf_config).text_config.hidden_dim,
        num_attention_heads=hf_config.n_heads, num_key_value_heads=hf_config.n_heads,
        num_experts=hf_config.moe_num_experts, num_experts_per_tok=hf_config.moe_top_k,
        norm_topk_prob=renormalize, rms_norm_eps=hf_config.layer_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": hf_config.rope_theta},
        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=None,
        eos_token_id=ENDOFTEXT)
    model = OlmoeForCausalLM(config).float().eval()
    model.load_state_dict(olmoe_state_dict(sd, hf_config), strict=True)
    return model


def vision_backbone(ckpt) -> MolmoVisionBackbone:
    """Our Molmo vision backbone with the checkpoint's vision weights."""
    backbone = MolmoVisionBackbone(molmoe_config_from_hf(_hf_config(ckpt)).vision_config)
    load_hf_vision_weights(backbone, load_file(ckpt / "model.safetensors"))
    return backbone.float().eval()


def greedy(decoder, embeds: torch.Tensor, max_tokens: int, head_rows: int) -> list[int]:
    """Greedy ids from prompt embeddings [tokens, d], stopping at
    <|endoftext|> as vLLM does; argmax over the head's own rows."""
    tokens: list[int] = []
    with torch.no_grad():
        out = decoder(inputs_embeds=embeds[None], use_cache=True)
        for _ in range(max_tokens):
            token = int(out.logits[0, -1, :head_rows].argmax())
            tokens.append(token)
            if token == ENDOFTEXT:
                break
            out = decoder(input_ids=torch.tensor([[token]]),
                          past_key_values=out.past_key_values, use_cache=True)
    return tokens


def reference_greedy(reference, text: str, images: list, max_tokens: int):
    """(prompt ids, greedy ids) of a prompt with images; reference =
    (olmoe decoder, our vision backbone, vLLM's processor, its tokenizer,
    the head's rows)."""
    decoder, backbone, processor, tokenizer, head_rows = reference
    ids, items = processed_prompt(processor, tokenizer, text, images)
    features = []
    for item in items:
        data = {key: value.data for key, value in item.items()}
        with torch.no_grad():
            features.append(image_embeddings(
                backbone, data["images"], data["image_masks"], data["image_input_idx"]))
    prompt = torch.tensor(ids)
    with torch.no_grad():
        embeds = decoder.model.embed_tokens(prompt)
        if features:
            embeds[prompt == IM_PATCH] = torch.cat(features)
    return list(ids), greedy(decoder, embeds, max_tokens, head_rows)
