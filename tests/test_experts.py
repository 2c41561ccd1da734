"""Mixture-of-experts layers (model/experts.py): ``Experts`` in place of FMS's
MOEFeedForward equals a naive reference (each token through its top-k
experts, one by one) in float32 and bfloat16 at several token counts, in
every form (our kernel, oneDNN, torch, dense), the top-k weights
renormalized or kept as the softmax gave them; with biases and the clamped
SwiGLU, equals transformers' own GPT-OSS MoE block; skips a bucket's padding
rows; compiles whole; and replaces only the MoE layers it computes exactly
(served end to end: test_generation.py, test_tensor_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fms.modules.feedforward import MOEFeedForward
from torch import nn

from vllm_accel import compat
from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.kernels import CpuKernels
from vllm_accel.kernels import linear as linear_kernel
from vllm_accel.model import experts
from vllm_accel.model.experts import DENSE, KERNEL, ONEDNN, TORCH, Experts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 64, 96, 8, 2
TOKENS = [1, 3, 16, 64]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the output's largest value


def fms_moe(dtype: torch.dtype, seed: int = 0, **kwargs) -> MOEFeedForward:
    """FMS's layer with random weights; a router of std 0.5 (logits spread
    over ~4): no near-tie between a token's 2nd and 3rd expert."""
    moe = MOEFeedForward(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            std = 0.5 if name == "gate.weight" else 0.1
            param.copy_(torch.randn(param.shape, generator=g) * std)
    return moe.to(dtype).eval()


def reference(moe: MOEFeedForward, x: torch.Tensor, logits: torch.Tensor,
              renormalize: bool = True) -> torch.Tensor:
    """Each token, one by one, through its top-k experts (float32; the
    router's logits as given): HF's routing, softmax over all experts, the
    top k renormalized (or not: OLMoE's norm_topk_prob=false)."""
    w13, w2 = moe.cond_ffn.w13.float(), moe.cond_ffn.w2.float()
    out = torch.zeros(x.shape[0], HIDDEN)
    for t, row in enumerate(x.float()):
        probs = F.softmax(logits[t].float(), dim=-1)
        weights, ids = probs.topk(TOP_K)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, ids.tolist()):
            gate, up = (w13[e] @ row).split(INTERMEDIATE)
            out[t] += weight * (w2[e] @ (F.silu(gate) * up))
    return out


def close(actual, expected, dtype) -> bool:
    scale = expected.abs().max().item()
    return (actual.float() - expected).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.fixture
def forms(kernel_cache):
    """form -> (the linear kernel it needs or None), for the forms this
    machine runs in the test's dtype; the kernel in the forward context."""
    kernel = linear_kernel.load(kernel_cache)
    if kernel is not None:
        kernel.dtypes = set(kernel.runs)  # every dtype its build runs here
    with set_forward_context(ForwardContext(kernels=CpuKernels(linear=kernel))):
        yield kernel


def runnable(form: str, dtype: torch.dtype, kernel) -> bool:
    if form == KERNEL:
        return kernel is not None and dtype in kernel.runs
    if form == ONEDNN:
        return compat.onednn_packs_dtype(dtype)
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [KERNEL, ONEDNN, TORCH, DENSE])
def test_experts_equal_a_per_token_reference(forms, form, dtype):
    if not runnable(form, dtype, forms):
        pytest.skip(f"{form} runs no {dtype} here")
    moe = fms_moe(dtype)
    layer = Experts(moe, form, forms)
    g = torch.Generator().manual_seed(1)
    for tokens in TOKENS:
        x = torch.randn(1, tokens, HIDDEN, generator=g).to(dtype)
        with torch.inference_mode():
            out = layer(x)
            expected = reference(moe, x[0], moe.gate(x[0]))
        assert out.shape == x.shape and out.dtype == dtype
        assert close(out[0], expected, dtype), (tokens, (out[0].float() - expected).abs().max())


@pytest.mark.parametrize("form", [KERNEL, ONEDNN, TORCH, DENSE])
def test_experts_keep_the_softmax_weights_when_the_layer_says_so(forms, form):
    """RoutedFeedForward(renormalize=False): Experts in every form, and the
    layer's own (dense) forward, equal the reference without renormalizing,
    which differs from the renormalized one by far more than the tolerance."""
    if not runnable(form, torch.float32, forms):
        pytest.skip(f"{form} runs no float32 here")
    moe = experts.RoutedFeedForward(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, renormalize=False)
    moe.load_state_dict(fms_moe(torch.float32).state_dict())
    layer = Experts(moe, form, forms)
    assert not layer.renormalize
    x = torch.randn(1, 16, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = reference(moe, x[0], moe.gate(x[0]), renormalize=False)
        assert close(layer(x)[0], expected, torch.float32)
        assert close(moe(x)[0], expected, torch.float32)
        assert not close(reference(moe, x[0], moe.gate(x[0])), expected, torch.float32)


def test_topk_first_routing_takes_the_softmax_of_the_top_logits():
    moe = fms_moe(torch.float32, topk_first=True)
    layer = Experts(moe, TORCH)
    x = torch.randn(5, HIDDEN)
    with torch.inference_mode():
        ids, weights = layer.route(x)
        top, want_ids = moe.gate(x).topk(TOP_K)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, F.softmax(top, dim=-1))


@pytest.mark.parametrize("form", [ONEDNN, TORCH])
def test_padding_rows_are_not_routed(form):
    """A call padded to a bucket (ForwardContext.live_rows): the live rows
    as computed alone, the padding rows zero."""
    moe = fms_moe(torch.float32)
    layer = Experts(moe, form)
    x = torch.randn(1, 16, HIDDEN)
    with torch.inference_mode():
        alone = layer(x[:, :5])
        with set_forward_context(ForwardContext().padded(16, 5)):
            padded = layer(x)
    torch.testing.assert_close(padded[:, :5], alone)
    assert not padded[:, 5:].any()


@pytest.mark.parametrize("form", [ONEDNN, DENSE])
def test_compiles_whole_with_static_shapes(form):
    """One graph per token count (fullgraph: no graph break), equal to eager."""
    torch._dynamo.reset()
    moe = fms_moe(torch.float32)
    layer = Experts(moe, form)
    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False)
    for tokens in (1, 16):
        x = torch.randn(1, tokens, HIDDEN)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)


def gpt_oss_moe_pair(dtype: torch.dtype):
    """transformers' GPT-OSS MoE block (router and experts, with biases) with
    random weights, and FMS's layer holding the same weights as the port
    loads them (model/gpt_oss.py: [experts, in, out] -> [experts, out, in],
    gate/up rows interleaved). Expert outputs reach the clamp (limit 1.5)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                          num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, swiglu_limit=1.5)
    hf = GptOssMLP(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            std = 0.5 if name.startswith("router") else 0.1
            param.copy_(torch.randn(param.shape, generator=g) * std)
    moe = MOEFeedForward(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, use_bias=True, topk_first=True,
                         swiglu_limit=1.5)
    with torch.no_grad():
        moe.gate.weight.copy_(hf.router.weight)
        moe.gate.bias.copy_(hf.router.bias)
        moe.cond_ffn.w13.copy_(hf.experts.gate_up_proj.transpose(1, 2))
        moe.cond_ffn.w13_bias.copy_(hf.experts.gate_up_proj_bias)
        moe.cond_ffn.w2.copy_(hf.experts.down_proj.transpose(1, 2))
        moe.cond_ffn.w2_bias.copy_(hf.experts.down_proj_bias)
    return hf.to(dtype).eval(), moe.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [KERNEL, ONEDNN, TORCH, DENSE])
def test_biased_experts_equal_transformers_gpt_oss_block(forms, form, dtype):
    if not runnable(form, dtype, forms):
        pytest.skip(f"{form} runs no {dtype} here")
    hf, moe = gpt_oss_moe_pair(dtype)
    layer = Experts(moe, form, forms)
    assert layer.biased and layer.swiglu_limit == 1.5
    g = torch.Generator().manual_seed(4)
    for tokens in TOKENS:
        x = torch.randn(1, tokens, HIDDEN, generator=g).to(dtype)
        with torch.inference_mode():
            out = layer(x)
            expected, _ = hf(x.float() if dtype == torch.float32 else x)
            # the clamp binds: an expert without it would differ
            gate_up = x[0].float() @ hf.experts.gate_up_proj[0].float()
            assert (gate_up[:, 0::2] > 1.5).any() or tokens < 16
        assert out.shape == x.shape and out.dtype == dtype
        assert close(out[0], expected[0].float(), dtype), \
            (tokens, (out[0].float() - expected[0].float()).abs().max())


def test_install_replaces_every_fms_moe_layer():
    class Block(nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.ff_sub_layer = fms_moe(torch.float32, **kwargs)
            self.norm = nn.LayerNorm(HIDDEN)

    model = nn.Sequential(Block(), Block(use_bias=True, swiglu_limit=7.0))
    assert experts.install(model) == 2
    want = ONEDNN if compat.onednn_packs_dtype(torch.float32) else TORCH
    assert model[0].ff_sub_layer.form == want  # no kernel given
    assert not model[0].ff_sub_layer.biased and model[1].ff_sub_layer.biased
    assert model[1].ff_sub_layer.swiglu_limit == 7.0
    assert type(model[1].norm) is nn.LayerNorm
