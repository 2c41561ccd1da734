"""vLLM's own Molmo (processing and MolmoForCausalLM), built offline on CPU
from the tiny Molmo fixture: the reference our Molmo port is checked against.

What it takes to build vLLM's model class outside an engine:

* a VllmConfig (``EngineArgs(...).create_engine_config()``). Our platform's
  ``check_and_update_config`` rejects architectures our runner cannot serve,
  so ``vllm_accel.model.fms_causal_lm.check_architecture`` is patched to
  accept MolmoForCausalLM while the config is built;
* vLLM's distributed state for one process (gloo, world size 1, TP = PP = 1);
* vLLM's hard-coded full-size ``VisionBackboneConfig`` replaced by the
  fixture's small one (the fixture records it in config.json).

vLLM's vision backbone then runs as is (its ViT attention picks the pure
PyTorch TORCH_SDPA backend on CPU). Its decoder's ``Attention`` layers need a
forward context with attention metadata and a KV cache bound by vLLM's model
runner; ``plain_causal_attention`` stands in for that with a textbook causal
SDPA over one sequence (everything else - qkv split, q/k norm, rotary, norm
placement, MLP, embedding merge, head - stays vLLM's code).
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket

import torch
import torch.nn.functional as F

from vllm_accel.testing.tiny_molmo import VISION_BACKBONE


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
def _accept_molmo_architecture():
    import vllm_accel.model.fms_causal_lm as fms_causal_lm

    original = fms_causal_lm.check_architecture
    fms_causal_lm.check_architecture = lambda archs: "MolmoForCausalLM"
    try:
        yield
    finally:
        fms_causal_lm.check_architecture = original


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

    from vllm_accel.multimodal.compat import install_shims

    install_shims()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with _accept_molmo_architecture():
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
