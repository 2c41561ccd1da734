"""Deterministic, offline generator of tiny random-weight HF checkpoints.

Tests need real-looking checkpoints (config, safetensors in hub key layout,
fast tokenizer, chat template, generation config) without network access.
Everything here is built from scratch: a byte-level BPE tokenizer trained on
a small built-in corpus, and random weights drawn from a seeded generator.

"qwen3" is a dense Qwen3ForCausalLM: per-head q/k RMSNorm, a head_dim apart
from hidden / heads, and the head tied to the embeddings (as Qwen3-0.6B).

Qwen2.5-VL and Molmo fixtures have modules of their own (tiny_qwen2_5_vl.py,
tiny_molmo.py); ``fixtures.make_tiny_model`` makes any of them.
"llava_next" is a Granite-Vision-like LlavaNextForConditionalGeneration
(SigLIP vision tower + Granite text model, multi-layer vision features, anyres
tiling) with its image processor, processor config and a chat template that
renders OpenAI-style content lists; it needs no torchvision.

Usage: see fixtures.py.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch
from safetensors.torch import save_file

# The fixtures this module writes (fixtures.py dispatches every architecture).
ARCHS = ("llama", "granite", "mistral", "qwen3", "mixtral", "llava_next")

# Shapes: small enough to build/run in well under a second, but with GQA
# (4 query heads sharing 2 KV heads) and head_dim 64 so parity tests exercise
# the same code paths as real models.
HIDDEN = 256
LAYERS = 4
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
VOCAB = 384  # total tokenizer size incl. specials; a multiple of 8 (no padding rows)
MAX_POS = 2048
# Qwen3 sets head_dim apart from hidden / heads (Qwen3-0.6B: 1024 / 16 heads of
# 128); this one is neither 64 (hidden / heads) nor a power of two.
QWEN3_HEAD_DIM = 96

# Mixtral: a sparse mixture of experts in place of each layer's MLP, each
# token routed to its top 2 of 4 experts (softmax router, weights renormalized).
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
EXPERT_INTERMEDIATE = 256
# The router's weight std, chosen so that the top-2 choice is clear. Its
# logits are weight rows dotted with a normalized hidden state (~1 per element,
# 256 of them): std 0.25 spreads them over ~4, and a token's 2nd and 3rd
# logits stay far apart compared with float32 rounding, so implementations
# that differ in the last bits (HF's matmul, oneDNN's, our kernel's) route
# every token alike. With HF's init std 0.02 they spread over ~0.3 and the
# 2nd-3rd gap came within 2e-5 on the tests' prompts: a choice left to
# rounding. tests/test_tiny_models.py checks the gap.
ROUTER_STD = 0.25
# Each fixture's weights come from the seed plus its offset: not Llama's
# weights under another architecture's name.
SEED_OFFSETS = {"mistral": 7919, "mixtral": 104_729, "qwen3": 15_485_863,
                "bamba": 49_979_687, "granitemoehybrid": 32_452_843}

# std 0.1 (not the usual 0.02) so logits are clearly peaked and greedy
# decoding wanders through many different tokens instead of repeating one.
WEIGHT_STD = 0.1
NORM_NOISE = 0.05  # norms = 1 + noise, so a swapped/missing norm is detectable

# Granite multipliers, as in granite-3.x 2B except logits_scaling. lm_head is
# drawn with std WEIGHT_STD * logits_scaling, so after the division the
# logits are as varied as llama's, yet a forgotten division is still obvious.
GRANITE_MULTIPLIERS = {
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 1.0 / HEAD_DIM,
    "logits_scaling": 4.0,
}
# Granite embeddings are scaled x12 while block outputs are scaled x0.22: with
# std 0.1 the current token's embedding dominates the residual stream and
# greedy output falls into short loops. 0.025 * 12 = 0.3 avoids that.
GRANITE_EMBED_STD = 0.025
# lm_head rows of tokens that should never be generated are scaled by this
# (not zeroed: keeps them random so there are no exact logit ties).
SUPPRESS_SCALE = 0.01

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]  # ids 0..5

# Llama-3 style template. The bos is part of the template because chat
# prompts are tokenized with add_special_tokens=False (HF and vLLM alike).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)

# Small fixed training corpus; byte-level BPE means any text still encodes.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still be a
useful model when the goal is testing: it loads fast, runs on any machine and
gives the same answer every time it is asked the same question.

Once upon a time there was a little robot who lived in a quiet town near the
sea. Every morning the robot walked to the harbour, counted the boats, and
wrote the numbers in a notebook: one, two, three, four, five, six, seven.
The people of the town liked the robot because it was kind and patient.

User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for its museums, its
food and the tower that stands by the river.

In computer science, a language model assigns a probability to a sequence of
words. Modern models are trained on large amounts of text and generate new
text one token at a time. The attention mechanism lets every position look at
the positions that came before it, and the cache stores keys and values so
that the next step does not repeat the work of the previous ones.

def add(a, b):
    return a + b  # 1 + 2 = 3; 10 * 20 = 200; [x for x in range(100)]

Hello, world! How are you today? I am fine, thank you. Please write a short
poem about the weather, the mountains and the stars at night.
"""


def build_tokenizer(*, image_token: str | None = None, chat_template: str = CHAT_TEMPLATE):
    """Train a byte-level BPE on CORPUS and wrap it as a PreTrainedTokenizerFast.

    With ``image_token`` that token is one more special token (id 6, right
    after SPECIAL_TOKENS; the vocabulary keeps VOCAB entries) and the
    tokenizer exposes it as ``tokenizer.image_token``/``image_token_id``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte-level pre-tokenizer/decoder: every byte has a token, so arbitrary
    # (unicode) text round-trips exactly -- needed by incremental detokenizers.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + ([image_token] if image_token else [])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:  # corpus too small for VOCAB merges
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB}")
    # Plain prompts get a bos like Llama 3 tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    extra = {"extra_special_tokens": {"image_token": image_token}} if image_token else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,  # keep decode() an exact inverse
        model_max_length=MAX_POS,
        **extra,
    )


MISTRAL_WINDOW = 40


def _hf_config(arch: str, tokenizer):
    from transformers import (GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Qwen3Config)

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if arch == "llama":
        cfg = LlamaConfig(head_dim=HEAD_DIM, **common)
        cfg.architectures = ["LlamaForCausalLM"]
    elif arch == "mistral":
        # A window shorter than the tests' longer prompts, its edge inside a
        # KV block: they attend (and free blocks) past it.
        cfg = MistralConfig(head_dim=HEAD_DIM, sliding_window=MISTRAL_WINDOW, **common)
        cfg.architectures = ["MistralForCausalLM"]
    elif arch == "qwen3":
        # q/k RMSNorm per head; the head tied to the embeddings, as in
        # Qwen3-0.6B. A rope_theta that is no library's default (Qwen3's own
        # is 1e6, Llama's 1e4), so a theta left at a default shows in the logits.
        common.update(tie_word_embeddings=True, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
        cfg = Qwen3Config(head_dim=QWEN3_HEAD_DIM, use_sliding_window=False, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
    elif arch == "mixtral":  # full attention (no sliding window), experts in place of the MLP
        common["intermediate_size"] = EXPERT_INTERMEDIATE
        cfg = MixtralConfig(head_dim=HEAD_DIM, sliding_window=None, num_local_experts=EXPERTS,
                            num_experts_per_tok=EXPERTS_PER_TOKEN, router_jitter_noise=0.0,
                            **common)
        cfg.architectures = ["MixtralForCausalLM"]
    else:
        # GraniteConfig has no head_dim argument: it is hidden // heads (= 64).
        cfg = GraniteConfig(**common, **GRANITE_MULTIPLIERS)
        cfg.architectures = ["GraniteForCausalLM"]
    return cfg


def _unprintable_ids(tokenizer, specials=tuple(SPECIAL_TOKENS)) -> list[int]:
    """Ids of special tokens and of tokens that are not printable ASCII alone
    (control bytes, lone UTF-8 bytes that decode to U+FFFD)."""

    def printable(text: str) -> bool:
        return bool(text) and all(c == "\n" or (c.isascii() and c.isprintable()) for c in text)

    return [
        i
        for i in range(len(tokenizer))
        if tokenizer.convert_ids_to_tokens(i) in specials
        or not printable(tokenizer.decode([i]))
    ]


def _random_state_dict(
    vocab: int, seed: int, *, embed_std: float, lm_head_std: float, suppressed: list[int],
    head_dim: int = HEAD_DIM, qk_norm: bool = False, tied: bool = False, experts: int = 0,
) -> dict[str, torch.Tensor]:
    """Random weights in HF hub key layout, drawn in a fixed order.
    ``qk_norm``: Qwen3's per-head q/k RMSNorm weights (``head_dim`` wide).
    ``tied``: no ``lm_head`` (the head is the embedding, whose rows of
    ``suppressed`` tokens are shrunk instead). ``experts``: Mixtral's router
    and experts in place of each MLP."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def norm(dim=HIDDEN):
        return 1.0 + NORM_NOISE * torch.randn(dim, generator=g, dtype=torch.float32)

    sd = {"model.embed_tokens.weight": normal(vocab, HIDDEN, std=embed_std)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm()
        sd[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "post_attention_layernorm.weight"] = norm()
        if experts:
            sd[p + "block_sparse_moe.gate.weight"] = normal(experts, HIDDEN, std=ROUTER_STD)
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                sd[q + "w1.weight"] = normal(EXPERT_INTERMEDIATE, HIDDEN)  # gate
                sd[q + "w2.weight"] = normal(HIDDEN, EXPERT_INTERMEDIATE)  # down
                sd[q + "w3.weight"] = normal(EXPERT_INTERMEDIATE, HIDDEN)  # up
            continue
        sd[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    sd["model.norm.weight"] = norm()
    if tied:
        sd["model.embed_tokens.weight"][suppressed] *= SUPPRESS_SCALE
        return sd
    lm_head = normal(vocab, HIDDEN, std=lm_head_std)
    lm_head[suppressed] *= SUPPRESS_SCALE
    sd["lm_head.weight"] = lm_head
    return sd


def write_model_checkpoint(out_dir: str | os.PathLike, model_class, make_config, seed: int,
                           fill_weights, printable_only: bool) -> pathlib.Path:
    """A tiny checkpoint built by HF's own ``model_class`` in ``out_dir``: the
    tiny tokenizer, ``make_config(tokenizer)``, weights drawn by
    ``fill_weights(model, generator)`` from ``seed``. ``printable_only``: the
    head rows of special and unprintable tokens are shrunk, so greedy output
    is printable text that runs to max_tokens."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    g = torch.Generator().manual_seed(seed)
    model = model_class(make_config(tokenizer)).eval()
    with torch.no_grad():
        fill_weights(model, g)
        if printable_only:
            model.lm_head.weight[_unprintable_ids(tokenizer)] *= SUPPRESS_SCALE
    model.save_pretrained(out)
    _save_generation_config(tokenizer, out)
    return out


def _save_tokenizer(tokenizer, out: pathlib.Path, chat_template: str) -> None:
    tokenizer.save_pretrained(out)
    # Some loaders only look at tokenizer_config.json for the template.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = chat_template
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


FILL_BIAS_STD = 0.02


def fill_weights(model, g: torch.Generator, std_of=lambda name: WEIGHT_STD) -> None:
    """Every parameter of an HF model redrawn from ``g``, in name order: norms
    (1-D weights) 1 + noise, biases small (non-zero, so one left unloaded
    shows), the rest normal with ``std_of(name)`` (WEIGHT_STD: peaked
    logits; HF's 0.02 init gives near-uniform ones)."""
    for name, parameter in sorted(model.named_parameters()):
        if name.endswith(".bias"):
            value = torch.randn(parameter.shape, generator=g) * FILL_BIAS_STD
        elif parameter.dim() == 1:  # RMSNorm and LayerNorm weights
            value = 1.0 + NORM_NOISE * torch.randn(parameter.shape, generator=g)
        else:
            value = torch.randn(parameter.shape, generator=g) * std_of(name)
        parameter.copy_(value)


def _save_generation_config(tokenizer, out: pathlib.Path) -> None:
    from transformers import GenerationConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, eot],  # stop on either, like Llama 3
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)


# ---------------------------------------------------------------------------
# LlavaNext (Granite Vision): SigLIP vision tower + Granite text model.
#
# Text part = the tiny granite above (same shapes, multipliers and weight
# recipe). Vision part: 64x64-pixel tiles of 8x8-pixel patches, so 64
# features per tile; anyres tiling over IMAGE_GRID_PINPOINTS; the projector
# input concatenates several SigLIP hidden states like granite-vision's
# vision_feature_layer [-24, -20, -12, -1]; "full" select strategy (SigLIP has
# no CLS token). Checkpoint keys are in the hub layout of granite-vision
# (language_model.model.*, language_model.lm_head.weight,
# vision_tower.vision_model.*, multi_modal_projector.*, image_newline): FMS
# reads exactly that, and transformers converts it on load.
# ---------------------------------------------------------------------------
IMAGE_TOKEN = "<image>"  # special token id 6 (after SPECIAL_TOKENS)
VISION_HIDDEN = 64
VISION_INTERMEDIATE = 256
VISION_LAYERS = 4
VISION_HEADS = 4  # head_dim 16
IMAGE_SIZE = 64  # pixels per tile side (and the resized base image)
PATCH_SIZE = 8  # (64 / 8)^2 = 64 features per tile
VISION_FEATURE_LAYERS = [-4, -2, -1]  # hidden_states has VISION_LAYERS + 1 entries
# (height, width) in pixels, multiples of IMAGE_SIZE: 1x1, 1x2, 2x1, 2x2, 1x3, 3x1 tiles.
IMAGE_GRID_PINPOINTS = [[64, 64], [64, 128], [128, 64], [128, 128], [64, 192], [192, 64]]
SIGLIP_MEAN_STD = [0.5, 0.5, 0.5]
VISION_SEED_OFFSET = 1_000_003  # vision weights use their own generator
BIAS_STD = 0.02  # biases non-zero so a bias left unloaded is detectable
# The projector output is added to the residual stream like a token
# embedding (and is multiplied by embedding_multiplier too), so its scale is
# kept near GRANITE_EMBED_STD: images then steer the text without swamping it.
PROJECTOR_STD = (0.05, 0.003)  # linear_1, linear_2

def vision_chat_template(image_text: str) -> str:
    """Llama-3 style like CHAT_TEMPLATE, but a message's content may also be
    an OpenAI-style list of parts: {"type": "image"} becomes ``image_text`` (a
    Jinja string literal's body: the model's image placeholder), {"type":
    "text", "text": ...} its text. vLLM detects the list loop ("openai"
    content format) and passes such lists; HF processors' apply_chat_template
    too."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if message['content'] is string %}"
        "{{ message['content'] | trim }}"
        "{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] in ('image', 'image_url') %}"
        "{{ '" + image_text + "' }}"
        "{% elif part['type'] == 'text' %}"
        "{{ part['text'] | trim }}"
        "{% endif %}"
        "{% endfor %}"
        "{% endif %}"
        "{{ '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}"
    )


VISION_CHAT_TEMPLATE = vision_chat_template("<image>\\n")


def _llava_next_config(tokenizer):
    from transformers import LlavaNextConfig, SiglipVisionConfig

    text = _hf_config("granite", tokenizer)
    text.architectures = None
    vision = SiglipVisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=VISION_INTERMEDIATE,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HEADS,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    )
    cfg = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="full",
        vision_feature_layer=list(VISION_FEATURE_LAYERS),
        image_grid_pinpoints=[list(p) for p in IMAGE_GRID_PINPOINTS],
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        dtype="float32",
    )
    cfg.architectures = ["LlavaNextForConditionalGeneration"]
    return cfg


def _vision_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """SigLIP tower (hub prefix vision_tower.vision_model.), projector and
    image_newline, drawn in a fixed order."""
    g = torch.Generator().manual_seed(seed + VISION_SEED_OFFSET)

    def normal(*shape, std=WEIGHT_STD):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * std

    def layer_norm(sd, name, dim=VISION_HIDDEN):
        sd[name + ".weight"] = 1.0 + NORM_NOISE * torch.randn(dim, generator=g)
        sd[name + ".bias"] = normal(dim, std=BIAS_STD)

    def linear(sd, name, out_dim, in_dim, std=WEIGHT_STD):
        sd[name + ".weight"] = normal(out_dim, in_dim, std=std)
        sd[name + ".bias"] = normal(out_dim, std=BIAS_STD)

    h, inter = VISION_HIDDEN, VISION_INTERMEDIATE
    sd: dict[str, torch.Tensor] = {}
    v = "vision_tower.vision_model."
    sd[v + "embeddings.patch_embedding.weight"] = normal(h, 3, PATCH_SIZE, PATCH_SIZE)
    sd[v + "embeddings.patch_embedding.bias"] = normal(h, std=BIAS_STD)
    sd[v + "embeddings.position_embedding.weight"] = normal((IMAGE_SIZE // PATCH_SIZE) ** 2, h)
    for i in range(VISION_LAYERS):
        p = f"{v}encoder.layers.{i}."
        layer_norm(sd, p + "layer_norm1")
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(sd, p + "self_attn." + proj, h, h)
        layer_norm(sd, p + "layer_norm2")
        linear(sd, p + "mlp.fc1", inter, h)
        linear(sd, p + "mlp.fc2", h, inter)
    layer_norm(sd, v + "post_layernorm")
    # Attention-pooling head: unused by LlavaNext, but part of every SigLIP
    # checkpoint (vision_use_head) and of the FMS and HF modules.
    sd[v + "head.probe"] = normal(1, 1, h)
    sd[v + "head.attention.in_proj_weight"] = normal(3 * h, h)
    sd[v + "head.attention.in_proj_bias"] = normal(3 * h, std=BIAS_STD)
    linear(sd, v + "head.attention.out_proj", h, h)
    layer_norm(sd, v + "head.layernorm")
    linear(sd, v + "head.mlp.fc1", inter, h)
    linear(sd, v + "head.mlp.fc2", h, inter)

    linear(sd, "multi_modal_projector.linear_1", HIDDEN, h * len(VISION_FEATURE_LAYERS),
           std=PROJECTOR_STD[0])
    linear(sd, "multi_modal_projector.linear_2", HIDDEN, HIDDEN, std=PROJECTOR_STD[1])
    sd["image_newline"] = normal(HIDDEN, std=GRANITE_EMBED_STD)
    return sd


def _write_json(path: pathlib.Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _make_llava_next(out: pathlib.Path, *, seed: int, printable_only: bool) -> pathlib.Path:
    tokenizer = build_tokenizer(image_token=IMAGE_TOKEN, chat_template=VISION_CHAT_TEMPLATE)
    _save_tokenizer(tokenizer, out, VISION_CHAT_TEMPLATE)
    cfg = _llava_next_config(tokenizer)
    cfg.save_pretrained(out)
    _save_generation_config(tokenizer, out)

    # Legacy two-file processor layout, as on the hub for granite-vision.
    # "LlavaNextImageProcessor" resolves to LlavaNextImageProcessorPil when
    # torchvision is missing (transformers 5 picks the backend at load time).
    _write_json(out / "preprocessor_config.json", {
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_grid_pinpoints": [list(p) for p in IMAGE_GRID_PINPOINTS],
        "image_mean": SIGLIP_MEAN_STD,
        "image_processor_type": "LlavaNextImageProcessor",
        "image_std": SIGLIP_MEAN_STD,
        "processor_class": "LlavaNextProcessor",
        "resample": 3,  # bicubic
        "rescale_factor": 1 / 255,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    })
    _write_json(out / "processor_config.json", {
        "image_token": IMAGE_TOKEN,
        "num_additional_image_tokens": 0,  # SigLIP: no CLS token
        "patch_size": PATCH_SIZE,
        "processor_class": "LlavaNextProcessor",
        "vision_feature_select_strategy": "full",
    })

    text_sd = _random_state_dict(
        cfg.text_config.vocab_size,
        seed,
        embed_std=GRANITE_EMBED_STD,
        lm_head_std=WEIGHT_STD * GRANITE_MULTIPLIERS["logits_scaling"],
        suppressed=(_unprintable_ids(tokenizer, specials=(*SPECIAL_TOKENS, IMAGE_TOKEN))
                    if printable_only else []),
    )
    sd = {("language_model." + k): t for k, t in text_sd.items()}  # model.* and lm_head.*
    sd.update(_vision_state_dict(seed))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_tiny_checkpoint(
    arch: str, out_dir: str | os.PathLike, *, seed: int = 0, printable_only: bool = True
) -> pathlib.Path:
    """Write a complete tiny HF checkpoint for ``arch`` into ``out_dir``.

    The output is byte-for-byte identical for the same (arch, seed) and the
    same library versions. Returns the checkpoint directory.

    With ``printable_only`` (default) the lm_head rows (Qwen3's tied head:
    the embedding rows) of special tokens
    (incl. eos) and of non-printable/partial-UTF-8 byte tokens are shrunk so
    their logits sit near 0, far below the top logits: greedy output is then
    clean ASCII text that always runs to max_tokens (no early eos), and text
    from incremental detokenization matches a one-shot decode.
    """
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; choose from {ARCHS}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "llava_next":
        return _make_llava_next(out, seed=seed, printable_only=printable_only)

    tokenizer = build_tokenizer()
    _save_tokenizer(tokenizer, out, CHAT_TEMPLATE)
    cfg = _hf_config(arch, tokenizer)
    cfg.save_pretrained(out)
    _save_generation_config(tokenizer, out)

    granite, qwen3 = arch == "granite", arch == "qwen3"
    sd = _random_state_dict(
        cfg.vocab_size,
        seed + SEED_OFFSETS.get(arch, 0),
        embed_std=GRANITE_EMBED_STD if granite else WEIGHT_STD,
        lm_head_std=WEIGHT_STD * (GRANITE_MULTIPLIERS["logits_scaling"] if granite else 1.0),
        suppressed=_unprintable_ids(tokenizer) if printable_only else [],
        head_dim=QWEN3_HEAD_DIM if qwen3 else HEAD_DIM, qk_norm=qwen3, tied=qwen3,
        experts=EXPERTS if arch == "mixtral" else 0,
    )
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
