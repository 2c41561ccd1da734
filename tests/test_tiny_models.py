"""Tests for the offline tiny-checkpoint generator (vllm_accel.testing.fixtures, tiny_models)."""

import hashlib
import logging
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from vllm_accel.testing.fixtures import SUPPORTED_ARCHS, make_tiny_model

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a story about a robot."},
]


def _hashes(path: pathlib.Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module", params=SUPPORTED_ARCHS)
def ckpt(request, tmp_path_factory) -> tuple[str, pathlib.Path]:
    arch = request.param
    return arch, make_tiny_model(arch, tmp_path_factory.mktemp(arch))


@pytest.fixture(scope="module")
def hf_model(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt[1])


def test_files_and_keys(ckpt):
    arch, path = ckpt
    names = {f.name for f in path.iterdir()}
    for required in ("config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"):
        assert required in names
    sd = load_file(path / "model.safetensors")
    if arch == "gpt_bigcode":  # StarCoder's layout: the head is the token embedding
        assert {"transformer.wte.weight", "transformer.wpe.weight",
                "transformer.h.3.attn.c_attn.weight", "transformer.ln_f.bias"} <= set(sd)
        assert len(sd) == 4 + 4 * 12  # wte, wpe, final norm (2), 12 tensors per layer
        return
    if arch == "mixtral":  # a router and 4 experts (w1, w2, w3 each) in place of the MLP
        assert {"model.layers.3.block_sparse_moe.gate.weight",
                "model.layers.3.block_sparse_moe.experts.3.w2.weight"} <= set(sd)
        assert not any(".mlp." in key for key in sd)
        assert len(sd) == 2 + 1 + 4 * (6 + 1 + 4 * 3)
        return
    if arch == "bamba":  # Mamba2 in layers 0, 2, 3; attention in layer 1
        assert {"model.embed_tokens.weight", "model.final_layernorm.weight", "lm_head.weight",
                "model.layers.0.mamba.A_log", "model.layers.3.mamba.conv1d.weight",
                "model.layers.1.self_attn.q_proj.weight"} <= set(sd)
        assert not any(k.startswith("model.layers.1.mamba") for k in sd)
        # embed, head, final norm; 2 norms and 3 MLP weights a layer; 8 in a mixer
        assert len(sd) == 3 + 4 * 5 + 3 * 8 + 4
        return
    if arch == "granitemoehybrid":  # Mamba2 in layers 0, 2, 3; experts beside a shared MLP
        assert {"model.layers.0.mamba.A_log", "model.layers.1.self_attn.q_proj.weight",
                "model.layers.2.shared_mlp.input_linear.weight", "lm_head.weight",
                "model.layers.3.block_sparse_moe.router.layer.weight"} <= set(sd)
        assert sd["model.layers.0.block_sparse_moe.input_linear.weight"].shape == (4, 256, 256)
        # embed, head, final norm; 2 norms, 2 shared MLP and 3 experts' weights a
        # layer; 8 in a mixer, 4 in attention
        assert len(sd) == 3 + 4 * 7 + 3 * 8 + 4
        return
    if arch == "gpt_oss":  # sinks; biases in attention, router and the stacked experts
        assert sd["model.layers.3.self_attn.sinks"].shape == (4,)
        assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 256, 2 * 256)
        assert {"model.layers.1.mlp.router.bias", "model.layers.2.self_attn.q_proj.bias",
                "model.layers.3.mlp.experts.down_proj_bias"} <= set(sd)
        # embed, head, final norm; 2 norms, 9 attention, 2 router, 4 experts' a layer
        assert len(sd) == 3 + 4 * 17
        return
    if arch == "granite_swa":  # a sink per head in every layer
        assert sd["model.layers.3.self_attn.sinks"].shape == (4,)
        assert len(sd) == 2 + 1 + 4 * 10  # embed, head, final norm, 10 tensors per layer
        return
    assert "model.embed_tokens.weight" in sd and "model.norm.weight" in sd
    assert "model.layers.3.self_attn.q_proj.weight" in sd
    if arch == "qwen3":  # the head tied to the embedding; q/k norms of head_dim, not 64
        from vllm_accel.testing.tiny_models import HEADS, QWEN3_HEAD_DIM

        assert "lm_head.weight" not in sd
        assert sd["model.layers.3.self_attn.k_norm.weight"].shape == (QWEN3_HEAD_DIM,)
        assert sd["model.layers.0.self_attn.o_proj.weight"].shape[1] == HEADS * QWEN3_HEAD_DIM
        assert len(sd) == 1 + 1 + 4 * 11  # embed, final norm, 11 tensors per layer
        return
    assert "lm_head.weight" in sd
    assert len(sd) == 2 + 1 + 4 * 9  # embed, head, final norm, 9 tensors per layer


def test_deterministic(tmp_path):
    a = make_tiny_model("llama", tmp_path / "a", seed=0)
    b = make_tiny_model("llama", tmp_path / "b", seed=0)
    c = make_tiny_model("llama", tmp_path / "c", seed=1)
    assert _hashes(a) == _hashes(b)
    ha, hc = _hashes(a), _hashes(c)
    assert ha["model.safetensors"] != hc["model.safetensors"]
    assert ha["tokenizer.json"] == hc["tokenizer.json"]  # tokenizer is seed independent
    g = make_tiny_model("granite", tmp_path / "g", seed=0)
    assert _hashes(g)["config.json"] != ha["config.json"]


def test_cli(tmp_path, capsys):
    from vllm_accel.testing.fixtures import main

    main(["granite", str(tmp_path / "cli"), "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").exists()


def test_fms_matches_hf(ckpt, hf_model, tokenizer, caplog):
    from fms.models import get_model

    from vllm_accel.architectures import by_model_type, load_object
    from vllm_accel.model.ports import register_port

    arch, path = ckpt
    entry = by_model_type(arch)
    if entry.fms_port is not None and entry.recurrent_state is not None:
        pytest.skip("our FMS port (its Mamba2 layers run over vLLM's paged state, inside an "
                    "engine): tests/test_generation.py compares it with HF")
    if entry.fms_port is not None:  # FMS's own class, loaded our way (Mixtral)
        register_port(load_object(entry.fms_port))
    with caplog.at_level(logging.WARNING):
        fms_model = get_model(
            "hf_pretrained", model_path=str(path), device_type="cpu", data_type=torch.float32,
            **entry.fms_config_overrides(hf_model.config)).eval()
    # FMS logs (and otherwise ignores) checkpoint keys it could not place.
    assert "not copied into model" not in caplog.text

    # Every parameter must come from the checkpoint: FMS fuses q/k/v and
    # gate/up (stacks experts), so compare total sizes plus a couple of tensors directly.
    sd = load_file(path / "model.safetensors")
    fms_params = dict(fms_model.named_parameters())  # a tied head once
    assert sum(t.numel() for t in fms_params.values()) == sum(t.numel() for t in sd.values())
    embedding, head = {"gpt_bigcode": ("transformer.wte.weight",) * 2,
                       "qwen3": ("model.embed_tokens.weight",) * 2}.get(
        arch, ("model.embed_tokens.weight", "lm_head.weight"))
    assert torch.equal(fms_params["base_model.embedding.weight"], sd[embedding])
    assert torch.equal(fms_model.head.weight, sd[head])

    ids = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    # Token 0 (the pad token) inside a prompt computes as any token in HF
    # (FMS's GPT-BigCode zeroed its position embedding: fms_overrides).
    ids = torch.cat([ids[:, :3], torch.tensor([[0]]), ids[:, 3:]], dim=1)
    # FMS's own attention has no window (the engine's op applies it): within it.
    ids = ids[:, : getattr(hf_model.config, "sliding_window", None) or ids.shape[1]]
    with torch.no_grad():
        hf_logits = hf_model(ids).logits
        # Both FMS Granite and HF GraniteForCausalLM already divide by
        # logits_scaling, so the outputs are directly comparable.
        fms_logits = fms_model(ids)
    assert fms_logits.shape == hf_logits.shape == (1, ids.shape[1], hf_model.config.vocab_size)
    torch.testing.assert_close(fms_logits, hf_logits, atol=1e-4, rtol=1e-4)
    # Logits are not flat.
    assert hf_logits[0, -1].std() > 0.5


def test_router_choices_are_clear(ckpt, hf_model):
    """Mixtral's, Granite 4's and GPT-OSS's fixtures route each token to 2 of 4 experts:
    the 2nd and 3rd router logits stay far apart compared with float32
    rounding, so that implementations that differ in the last bits pick the
    same experts (tiny_models.ROUTER_STD)."""
    import random

    # Each family's router, and where its output holds the logits.
    routers = {"mixtral": lambda layer: (layer.mlp.gate, 0),
               "granitemoehybrid": lambda layer: (layer.block_sparse_moe.router, 2),
               "gpt_oss": lambda layer: (layer.mlp.router, 0)}
    if ckpt[0] not in routers:
        pytest.skip("no experts")
    gaps = []
    hooks = []
    for layer in hf_model.model.layers:
        router, at = routers[ckpt[0]](layer)

        def record(module, args, output, at=at):
            top = output[at].topk(3, dim=-1).values
            gaps.append(top[:, 1] - top[:, 2])

        hooks.append(router.register_forward_hook(record))
    rng = random.Random(0)
    try:
        with torch.no_grad():
            for length in (1, 7, 33, 100, 300):
                ids = torch.tensor([[rng.randrange(6, 384) for _ in range(length)]])
                hf_model.generate(ids, max_new_tokens=16, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.cat(gaps).min() > 1e-4


def test_greedy_generation_varied(ckpt, hf_model, tokenizer):
    ids = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = hf_model.generate(ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 24  # specials (incl. eos) are suppressed: no early stop
    assert len(set(new)) >= 5
    text = tokenizer.decode(new)
    assert text.isascii() and "\ufffd" not in text


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  leading and trailing spaces  \n\tTabs\r\nCRLF",
        "Ünïcödé: naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά, עברית",
        "def f(x):\n    return x ** 2  # comment",
        "",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # bos added for plain prompts
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenizer_and_chat_template(ckpt, tokenizer):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt[1])
    assert 300 <= len(tokenizer) <= 512
    assert config.vocab_size == len(tokenizer)
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token == "<|pad|>"

    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert "Tell me a story about a robot.<|eot_id|>" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_gen = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert prompt.startswith(no_gen) and not no_gen.endswith("assistant<|end_header_id|>\n\n")

    # Markers are single special tokens and the template's bos is not doubled.
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") in ids


def test_gpt_oss_swiglu_clamp_binds(ckpt, hf_model):
    """GPT-OSS's fixture: some experts' gate or up values pass the SwiGLU
    clamp (7.0) on ordinary prompts, so a forward without the clamp differs."""
    if ckpt[0] != "gpt_oss":
        pytest.skip("GPT-OSS only")
    limit = hf_model.config.swiglu_limit
    beyond = []
    for layer in hf_model.model.layers:
        experts = layer.mlp.experts

        def apply_gate(gate_up, original=experts._apply_gate):
            beyond.append(int((gate_up[..., ::2] > limit).sum()
                              + (gate_up[..., 1::2].abs() > limit).sum()))
            return original(gate_up)

        experts._apply_gate = apply_gate
    try:
        with torch.no_grad():
            hf_model(torch.arange(6, 70)[None])
    finally:
        for layer in hf_model.model.layers:
            del layer.mlp.experts._apply_gate
    assert sum(beyond) > 0
