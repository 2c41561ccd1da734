"""vLLM's own Molmo (processing and MolmoForCausalLM), built offline on CPU
from the tiny Molmo fixture: the reference our Molmo port is checked against.

What it takes to build vLLM's model class outside an engine:

* a VllmConfig (``EngineArgs(...).create_engine_config()``, through our
  platform, which serves MolmoForCausalLM);
* vLLM's distributed state for one process (gloo, world size 1, TP = PP = 1);
* vLLM's hard-coded full-size ``VisionBackboneConfig`` replaced by the
  fixture's small one (the fixture records it in config.json).

vLLM's vision backbone then runs as is (its ViT attention picks the pure
PyTorch TORCH_SDPA backend on CPU). Its decoder's ``Attention`` layers need
what vLLM's model runner provides: a forward context with attention metadata,
a paged KV cache bound to each layer, a slot mapping. Two ways here:

* ``paged_forward``: vLLM's own FlexAttention backend (our platform's
  attention backend) over one sequence. It runs on CPU once the one C++ op
  it calls, ``_C_cache_ops.reshape_and_cache_flash`` (absent from the
  pure-Python build), has a Python stand-in (``register_python_cache_op``),
  ``cache_config.num_gpu_blocks`` is set and the cache is allocated in the
  physical layout Flex expects ([blocks, block_size, kv_heads, 2 * head_dim]
  seen as [blocks, kv_heads, block_size, 2 * head_dim]). First call ~8 s:
  vLLM compiles flex_attention.
* ``plain_causal_attention``: a textbook causal SDPA in place of the paged
  attention (instant). Everything else - qkv split, q/k norm, rotary, norm
  placement, MLP, embedding merge, head - stays vLLM's code either way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket

import torch
import torch.nn.functional as F

from vllm_accel.testing.tiny_molmo import EMBEDDING_SIZE, VISION_BACKBONE

IM_PATCH = EMBEDDING_SIZE + 2
ENDOFTEXT = EMBEDDING_SIZE - 8


_modules_cache: str | None = None


def isolate_remote_code_cache(path) -> str:
    """Make trust_remote_code copy the fixture's code under ``path`` instead of
    ~/.cache/huggingface/modules. transformers reads HF_MODULES_CACHE once, at
    import, so its module constants are patched too. Once per process: the
    first directory stays (it is put on sys.path with the copied modules)."""
    global _modules_cache
    if _modules_cache is None:
        import sys

        _modules_cache = str(path)
        os.environ["HF_MODULES_CACHE"] = _modules_cache  # later imports, subprocesses
        for name in ("transformers.utils.hub", "transformers.utils",
                     "transformers.dynamic_module_utils"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "HF_MODULES_CACHE"):
                module.HF_MODULES_CACHE = _modules_cache
    return _modules_cache


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_distributed() -> None:
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                                     backend="gloo")
    ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def small_vision_backbone_config(vision_backbone: dict = VISION_BACKBONE):
    """vLLM's MolmoForCausalLM calls ``VisionBackboneConfig()``: give it the
    fixture's dimensions while the model is built."""
    import vllm.model_executor.models.molmo as vllm_molmo

    original = vllm_molmo.VisionBackboneConfig
    vllm_molmo.VisionBackboneConfig = functools.partial(original, **vision_backbone)
    try:
        yield
    finally:
        vllm_molmo.VisionBackboneConfig = original


def vllm_config(ckpt, max_model_len: int = 2048):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_accel.patches import apply_patches

    apply_patches()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return EngineArgs(model=str(ckpt), trust_remote_code=True, dtype="float32",
                      max_model_len=max_model_len, seed=0,
                      enforce_eager=True).create_engine_config()


def build_vllm_molmo(ckpt):
    """(vLLM's MolmoForCausalLM with the fixture's weights, float32, CPU, eval;
    the VllmConfig; names of the parameters load_weights reported loaded)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.molmo import MolmoForCausalLM

    config = vllm_config(ckpt)
    with set_current_vllm_config(config), small_vision_backbone_config():
        ensure_single_process_distributed()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = MolmoForCausalLM(vllm_config=config, prefix="")
        finally:
            torch.set_default_dtype(previous)
        loaded = model.load_weights(load_file(ckpt / "model.safetensors").items())
    return model.eval(), config, set(loaded)


def vllm_processor(config):
    """vLLM's Molmo multimodal processor: (processor, tokenizer)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    processor = MULTIMODAL_REGISTRY.create_processor(config.model_config)
    return processor, processor.info.get_tokenizer()


@contextlib.contextmanager
def plain_causal_attention():
    """Replace vLLM's paged ``Attention.forward`` by causal SDPA over one
    sequence ([tokens, heads * head_dim] in and out; GQA repeats kv heads)."""
    from vllm.model_executor.layers.attention import Attention

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        q = query.view(-1, self.num_heads, self.head_size).transpose(0, 1)
        k = key.view(-1, self.num_kv_heads, self.head_size).transpose(0, 1)
        v = value.view(-1, self.num_kv_heads, self.head_size).transpose(0, 1)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.impl.scale)
        return out.transpose(0, 1).reshape(query.shape[0], -1)

    original = Attention.forward
    Attention.forward = forward
    try:
        yield
    finally:
        Attention.forward = original


def register_python_cache_op() -> None:
    """A Python ``_C_cache_ops.reshape_and_cache_flash`` (the C++ op that
    writes new keys/values into the paged cache), if the op is missing."""
    if hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        return
    global _cache_op_library
    _cache_op_library = torch.library.Library("_C_cache_ops", "FRAGMENT")
    _cache_op_library.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, "
        "Tensor k_scale, Tensor v_scale) -> ()")

    def write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
              v_scale):
        # caches: [blocks, block_size, kv_heads, head_dim] (strided views)
        block, offset = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
        key_cache[block, offset] = key.view(-1, *key_cache.shape[2:])
        value_cache[block, offset] = value.view(-1, *value_cache.shape[2:])

    _cache_op_library.impl("reshape_and_cache_flash", write, "CompositeExplicitAutograd")


_cache_op_library = None


def paged_forward(model, config, input_ids, positions, inputs_embeds=None, block_size=32):
    """vLLM's ``model(input_ids, positions, inputs_embeds=...)`` for one
    sequence (a prefill from position 0) through vLLM's FlexAttention backend
    with a fresh paged KV cache, as vLLM's model runner would call it."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    register_python_cache_op()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Attention)}
    first = next(iter(layers.values()))
    heads, head_dim = first.num_kv_heads, first.head_size
    tokens = len(positions)
    blocks = -(-tokens // block_size) + 1  # block 0 stays unused, as in vLLM
    config.cache_config.num_gpu_blocks = blocks
    for layer in layers.values():
        layer.kv_cache = torch.zeros(blocks, block_size, heads, 2 * head_dim).transpose(1, 2)
    # (our layers' caches stay bound afterwards; every call binds fresh ones)
    slots = torch.arange(tokens) + block_size
    start_loc = torch.tensor([0, tokens], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=start_loc, query_start_loc_cpu=start_loc,
        seq_lens=torch.tensor([tokens], dtype=torch.int32), num_reqs=1,
        num_actual_tokens=tokens, max_query_len=tokens, max_seq_len=tokens,
        block_table_tensor=torch.arange(1, blocks, dtype=torch.int32)[None],
        slot_mapping=slots, causal=True)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim,
                             dtype=torch.float32)  # build_vllm_molmo's dtype
    with set_current_vllm_config(config):
        builder = FlexAttentionMetadataBuilder(spec, list(layers), config, torch.device("cpu"))
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
        with set_forward_context({name: metadata for name in layers}, config,
                                 num_tokens=tokens,
                                 slot_mapping={name: slots for name in layers}):
            return model(input_ids, positions, inputs_embeds=inputs_embeds)


def image(width, height, seed=0):
    """A deterministic RGB noise image (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def molmo_checkpoint(tmp_path_factory):
    """The tiny Molmo, its remote code cached under the session's temp dir."""
    from vllm_accel.testing.tiny_molmo import make_tiny_molmo

    isolate_remote_code_cache(tmp_path_factory.getbasetemp() / "hf_modules")
    return make_tiny_molmo(tmp_path_factory.mktemp("molmo") / "m")


def processed_prompt(processor, tokenizer, text: str, images: list):
    """(prompt ids, the images' processed items) as vLLM's Molmo processing
    gives them; a text-only prompt is only tokenized (vLLM runs no multimodal
    processing for it: no bos added)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not images:
        return ids, []
    out = processor(ids, processor.info.parse_mm_data({"image": images}))
    return out["prompt_token_ids"], list(out["mm_kwargs"]["image"])


def reference_greedy(reference, text, images, max_tokens: int):
    """(prompt ids, generated ids, logprob of each generated token, per-step
    logits [steps, vocab]) from vLLM's own Molmo, full recompute each step."""
    from vllm.multimodal.inputs import MultiModalKwargsItems

    model, processor, tokenizer = reference
    ids, items = processed_prompt(processor, tokenizer, text, images)
    prompt_ids = torch.tensor(ids)
    with torch.no_grad(), plain_causal_attention():
        embeds = []
        if items:
            embeds = list(model.embed_multimodal(**MultiModalKwargsItems({"image": items})
                                                 .get_data()))
        prompt_embeds = model.embed_input_ids(prompt_ids, embeds,
                                              is_multimodal=prompt_ids == IM_PATCH)
        generated, logprobs, logits_seen = [], [], []
        for _ in range(max_tokens):
            new = torch.tensor(generated, dtype=torch.long)
            x = torch.cat([prompt_embeds, model.embed_input_ids(new)])
            hidden = model(None, torch.arange(x.shape[0]), inputs_embeds=x)
            logits = model.compute_logits(hidden[-1:])[0].float()
            token = int(logits.argmax())
            generated.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            logits_seen.append(logits)
            if token == ENDOFTEXT:
                break
    return prompt_ids.tolist(), generated, logprobs, torch.stack(logits_seen)
