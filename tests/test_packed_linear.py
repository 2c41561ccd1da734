"""Linear layers over oneDNN-packed weights (the cpu device): equal to
nn.Linear, eager and compiled with the weights as graph inputs, and every
linear layer of a served model packed (our kernel's own: test_linear_kernel.py)."""

from __future__ import annotations

import collections
import dataclasses


import pytest
import torch
from torch import nn

from helpers import hf_greedy, model_runner, running_llm
from test_generation import random_prompts
from vllm_accel import compat
from vllm_accel.kernels import linear as linear_kernel
from vllm_accel.model.packed_linear import GatedUnit, PackedLinear, pack_linear_layers

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# oneDNN packs bfloat16 only with the instructions for it (AVX-512 BF16, AMX,
# AVX-NE-CONVERT): with AVX2 alone our kernel runs it (test_linear_kernel.py).
ONEDNN_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not compat.onednn_packs_dtype(torch.bfloat16), reason="oneDNN packs no bfloat16 here"))]


def linear(in_features, out_features, bias, dtype, seed):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        layer.bias.normal_() if bias else None
    return layer


def close(actual, expected, dtype):
    scale = expected.abs().max().item()
    return (actual.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear(dtype, bias):
    layer = linear(96, 160, bias, dtype, seed=0)
    packed = PackedLinear(layer, None)
    for shape in [(1, 96), (37, 96), (1, 19, 96)]:
        x = torch.randn(shape).to(dtype)
        with torch.inference_mode():
            out = packed(x)
        assert out.shape == (*shape[:-1], 160) and out.dtype == dtype
        assert close(out, layer(x).detach(), dtype)


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
def test_compiled_graph_shared_by_two_packed_layers(dtype):
    """One inductor graph, the packed weight a graph input (as compile.py
    shares one graph between layers): each layer gets its own result."""
    layers = [linear(64, 128, True, dtype, seed) for seed in (1, 2)]
    packed = [PackedLinear(layer, None) for layer in layers]

    def block(module, x):
        return torch.relu(module(x)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", dynamic=False, fullgraph=True)
    x = torch.randn(1, 8, 64).to(dtype)
    with torch.inference_mode():
        for layer, module in zip(layers, packed):
            assert close(compiled(module, x), block(layer, x), dtype)


def test_pack_linear_layers_keeps_read_weights_and_tied_embeddings():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(50, 32)
            self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            self.head = nn.Linear(32, 50, bias=False)
            self.head.weight = self.embedding.weight  # tied
            self.alias = self.mlp[0]  # one layer under two names

        def forward(self, ids):
            x = self.embedding(ids)
            x = x + self.attention(x, x, x)[0]
            return self.head(self.mlp(x))

    torch.manual_seed(0)
    model = Model().eval()
    ids = torch.randint(0, 50, (1, 7))
    with torch.inference_mode():
        expected = model(ids)
    assert pack_linear_layers(model, None) == 3  # mlp's two and the head, not out_proj
    assert isinstance(model.attention.out_proj, nn.Linear)  # MHA reads its weight
    assert model.alias is model.mlp[0] and isinstance(model.alias, PackedLinear)
    assert isinstance(model.embedding.weight, nn.Parameter)  # still dense for the lookup
    with torch.inference_mode():
        assert close(model(ids), expected, torch.float32)


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("activation", [nn.GELU(approximate="tanh"), nn.GELU(), nn.ReLU(),
                                        nn.SiLU()], ids=["gelu-tanh", "gelu", "relu", "silu"])
def test_feed_forward_activation_runs_in_the_matmul(activation, dtype):
    """An FMS FeedForwardBlock's activation moves into its first packed matmul
    (a oneDNN post-op): the block computes what it did, eager and compiled."""
    from fms.modules.feedforward import FeedForwardBlock

    torch.manual_seed(0)
    block = FeedForwardBlock(48, hidden_grow_factor=2.0, activation_fn=activation,
                             use_bias=True).to(dtype).eval()
    with torch.no_grad():
        for layer in (block.w1, block.w2):
            layer.weight.normal_(0, 0.2), layer.bias.normal_()
    x = torch.randn(2, 13, 48).to(dtype)
    with torch.inference_mode():
        expected = block(x)
        assert pack_linear_layers(block, None) == 2
        assert isinstance(block.a, nn.Identity) and block.w1.post_op[0] != "none"
        assert close(block(x), expected, dtype)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="inductor", dynamic=False, fullgraph=True)
        assert close(compiled(x), expected, dtype)


def test_unmapped_activation_stays_outside():
    """Activations not mapped to a oneDNN post-op are left as they are."""
    from fms.modules.feedforward import FeedForwardBlock

    block = FeedForwardBlock(16, activation_fn=nn.Tanh(), use_bias=True).eval()
    pack_linear_layers(block, None)
    assert isinstance(block.a, nn.Tanh) and block.w1.post_op == ("none", "")


def test_activation_stays_where_its_layer_is_not_packed():
    """A block whose first layer keeps another dtype (left dense) keeps its activation."""
    from fms.modules.feedforward import FeedForwardBlock

    torch.manual_seed(0)
    block = FeedForwardBlock(16, activation_fn=nn.GELU(), use_bias=True).eval()
    block.w1.half()
    model = nn.Sequential(nn.Linear(16, 16), block)  # a float32 model
    assert pack_linear_layers(model, None) == 2  # its first layer and the block's second
    assert type(block.w1) is nn.Linear and isinstance(block.a, nn.GELU)


def test_pack_linear_layers_leaves_float16():
    model = nn.Sequential(nn.Linear(8, 8)).half()
    assert pack_linear_layers(model, None) == 0
    assert type(model[0]) is nn.Linear


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_model_runs_packed_linears(tiny_models, dtype, monkeypatch):
    """The cpu device packs every linear layer of the model it serves (for our
    kernel where this CPU runs it); greedy output stays HF's in float32 (bfloat16: packed and HF differ in rounding,
    so only the counts are checked), our kernel multiplying no padding rows."""
    prompts = random_prompts([5, 17, 40], seed=7)
    with running_llm(tiny_models["llama"], dtype=dtype) as llm:
        runner = model_runner(llm)
        modules = list(runner.model.modules())
        assert not [m for m in modules if isinstance(m, nn.Linear)]
        # 4 per decoder layer (fused q/k/v, output, fused gate/up, down) and the head;
        # where our kernel runs the dtype, gate/up with its SiLU * up as one GatedUnit
        packed = [m for m in modules if isinstance(m, PackedLinear)]
        gated = [m for m in modules if isinstance(m, GatedUnit)]
        by_kernel = linear_kernel.runs(runner.kernels.linear, getattr(torch, dtype))
        assert len(gated) == (runner.model.num_layers if by_kernel else 0)
        assert len(packed) + len(gated) == 4 * runner.model.num_layers + 1
        # Llama fuses no activation into oneDNN, so every layer runs by our kernel
        # where it runs the dtype (float32: AVX-512; bfloat16: AVX-512 BF16, AMX
        # tiles, or AVX2 alone)
        assert [m.by_kernel for m in packed] == [by_kernel] * len(packed)
        if dtype == "float32":
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            kernel, rows = runner.kernels.linear, collections.Counter()

            class RowsSeen:
                def __call__(self, x, *args, **kwargs):
                    rows[x.shape[0]] += 1
                    return kernel(x, *args, **kwargs)

            if by_kernel:
                monkeypatch.setattr(runner, "kernels",
                                    dataclasses.replace(runner.kernels, linear=RowsSeen()))
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == \
                hf_greedy(tiny_models["llama"], prompts, 12)
            if by_kernel:
                # 62 prompt tokens (bucket 64), then 11 steps of 3 decodes (bucket
                # 8): no call multiplies a bucket's padding, and every decode
                # step's 4 linears a layer run on 3 rows (the LM head adds 12).
                assert not {8, 64} & set(rows)
                assert rows[3] >= 11 * 4 * runner.model.num_layers + 12
