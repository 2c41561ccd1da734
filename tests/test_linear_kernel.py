"""The CPU linear kernel against float64 (and oneDNN's error there), through
the op the packed linear layers call, and which layers run by it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_accel import devices
from vllm_accel.forward_context import ForwardContext, get_forward_context, set_forward_context
from vllm_accel.kernels import CpuKernels
from vllm_accel.kernels import build as cpu_kernels
from vllm_accel.kernels import linear as linear_kernel
from vllm_accel.kernels import span_attention
from vllm_accel.model.packed_linear import PackedLinear, pack_linear_layers

CPU_FLAGS = cpu_kernels.cpu_flags() or set()
WIDENS = devices.cpu_widens_bfloat16()
pytestmark = [pytest.mark.skipif("avx512f" not in CPU_FLAGS and not WIDENS,
                                 reason="the kernel needs AVX-512 or AVX2"),
              pytest.mark.usefixtures("every_core")]
# bfloat16: by AVX-512 BF16 dot products (or AMX), or widened to float32 without them.
BF16_RUNS = "avx512_bf16" in CPU_FLAGS or WIDENS
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_RUNS, reason="bfloat16 needs AVX-512 BF16, or AVX-512 BW/VL or AVX2 to widen it")), torch.float32]


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One build of the kernel for the module's tests (a build takes seconds)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture
def kernel(kernel_cache):
    """The kernel, running every dtype its build runs (AMX or not), in the
    forward context for the whole test (as an engine's forwards have it)."""
    kernel = linear_kernel.load(kernel_cache)
    assert kernel is not None
    kernel.dtypes = set(kernel.runs)
    with set_forward_context(ForwardContext(kernels=CpuKernels(linear=kernel))):
        yield kernel


def _errors(x, weight, bias, dtype):
    """Max error against float64 of the kernel and of oneDNN's packed matmul
    (torch's linear where oneDNN does not pack the dtype: bfloat16 with AVX2)."""
    from vllm_accel import compat

    reference = torch.nn.functional.linear(x.double(), weight.double(),
                                           None if bias is None else bias.double())
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    kernel = get_forward_context().kernels.linear
    ours = linear_kernel.linear(x, kernel.pack(weight), bias, weight.shape[0])
    if compat.onednn_packs_dtype(dtype):
        onednn = compat.onednn_linear(x, compat.onednn_pack_linear_weight(weight), bias)
    else:
        onednn = torch.nn.functional.linear(x, weight, bias)
    assert ours.shape == onednn.shape and ours.dtype == dtype
    return [(out.double() - reference).abs().max().item() if out.numel() else 0.0
            for out in (ours, onednn)]


@pytest.mark.parametrize("rows", [0, 1, 6, 7, 8, 13, 32, 64, 65, 300])
@pytest.mark.parametrize("in_features, out_features", [(96, 160), (1024, 1536), (34, 5),
                                                       (2816, 200)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_as_accurate_as_onednn(kernel, rows, in_features, out_features, dtype):
    """Row counts around the kernel's tiles (up to 7 rows each; AMX: groups of
    16, two at a time) and none (seen while serving), columns not a
    multiple of its 64-column blocks (and fewer than one vector), one block or
    many (the next one prefetched), a bias or none; AMX: x past 1.25 MB (300
    rows of 2,816) in two sweeps over the blocks, the second of an odd number
    of groups."""
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    for bias in (None, torch.randn(out_features, generator=g)):
        ours, onednn = _errors(x, weight, bias, dtype)
        if dtype == torch.bfloat16:  # both round the same float32 sums once
            assert ours <= onednn * 1.01 + 1e-6
        else:  # one float32 sum along K (oneDNN's blocks sum shorter runs)
            assert ours <= max(4 * onednn, 1e-5)


@pytest.mark.parametrize("in_features", [96, 34, 2816])
@pytest.mark.parametrize("epilogue", [linear_kernel.PLAIN, linear_kernel.GATED_SILU,
                                      linear_kernel.GELU_TANH])
def test_amx_rows_copied_into_tiles_compute_what_rows_read_in_place_do(kernel, in_features,
                                                                       epilogue):
    """A call of an encoder MLP's size (1,037 rows into 2,048 packed
    columns) has the AMX kernel copy x into its tiles before multiplying:
    every row's output is, bit for bit, what the same row gives in calls of
    fewer rows (x read in place, a K not a multiple of 32 with its last step
    copied into a tile a group, a last partial group copied as rows), and as
    accurate as oneDNN against
    float64; a last partial group, K a multiple of 32 or not, each
    epilogue, a bias."""
    if not kernel.multiplies_on_amx:
        pytest.skip("the AMX kernel's path (this CPU or build has no AMX)")
    rows, out_features = 1037, 2048
    g = torch.Generator().manual_seed(in_features + epilogue)
    x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=g)
              / in_features ** 0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    if epilogue == linear_kernel.GATED_SILU:
        packed, packed_bias = kernel.pack_gated(*weight.split(out_features // 2),
                                                       *bias.split(out_features // 2))
        outputs = out_features // 2
    else:
        packed, packed_bias, outputs = kernel.pack(weight), bias, out_features
    assert kernel.copies_x_into_tiles(rows, outputs, epilogue)
    assert not kernel.copies_x_into_tiles(500, outputs, epilogue)
    whole = linear_kernel.linear(x, packed, packed_bias, outputs, epilogue)
    parts = torch.cat([linear_kernel.linear(x[i:i + 500], packed, packed_bias, outputs, epilogue)
                       for i in range(0, rows, 500)])
    assert whole.shape == (rows, outputs) and torch.equal(whole, parts)
    if epilogue == linear_kernel.PLAIN:
        ours, onednn = _errors(x.float(), weight.float(), bias.float(), torch.bfloat16)
        assert ours <= onednn * 1.01 + 1e-6


def test_a_call_after_one_with_nan_inputs_is_unaffected(kernel):
    """The AMX kernel copies a last, partial group's rows of x (and, where K
    is not a multiple of 32, each group's last step) into a buffer it keeps
    from call to call, K padded with zeros: a call whose K is shorter than
    the last one's must find zeros past its K, not the last call's inputs
    (NaN there times the packed weights' zeros would be NaN). Other builds
    read x in place: the same must hold."""
    if not linear_kernel.runs(kernel, torch.bfloat16):
        pytest.skip("this CPU's kernel runs no bfloat16")
    g = torch.Generator().manual_seed(0)
    poisoned = torch.full((40, 62), float("nan"), dtype=torch.bfloat16)
    linear_kernel.linear(poisoned, kernel.pack(torch.ones(8, 62, dtype=torch.bfloat16)),
                         None, 8)
    x = torch.randn(40, 34, generator=g).to(torch.bfloat16)
    weight = torch.randn(24, 34, generator=g).to(torch.bfloat16)
    ours = linear_kernel.linear(x, kernel.pack(weight), None, 24)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 7, 48, 300])
@pytest.mark.parametrize("out_features", [16, 37, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_is_silu_of_gate_times_up(kernel, rows, out_features, dtype):
    """A fused gate/up weight packed gated: the kernel stores what the layer
    unfused and then the graph computed: gate and up as the layer outputs them
    (rounded to the dtype), silu(gate) * up in float32, rounded once; outputs
    not a multiple of a half block (16 or 32 columns), a bias or none."""
    g = torch.Generator().manual_seed(rows + out_features)
    in_features = 96
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(2 * out_features, in_features, generator=g)
              / in_features ** 0.5).to(dtype)
    for bias in (None, torch.randn(2 * out_features, generator=g).to(dtype)):
        gate_up_biases = (None, None) if bias is None else bias.split(out_features)
        ours = linear_kernel.linear(
            x, *kernel.pack_gated(*weight.split(out_features), *gate_up_biases),
            out_features, linear_kernel.GATED_SILU)
        halves = linear_kernel.linear(x, kernel.pack(weight), bias,
                                      2 * out_features).float()
        expected = (torch.nn.functional.silu(halves[:, :out_features])
                    * halves[:, out_features:]).to(dtype)
        assert ours.shape == (rows, out_features) and ours.dtype == dtype
        # Our SiLU (its exponential good to ~1e-7): float32 within 1e-6
        # (measured 5.2e-7 at most), bfloat16 the same but where the product
        # lies next to a rounding boundary (one unit apart).
        tolerance = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        assert ((ours.float() - expected.float()).abs()
                <= tolerance * expected.float().abs() + 1e-30).all()
        if dtype == torch.bfloat16:
            assert (ours == expected).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 7, 48, 300])
@pytest.mark.parametrize("out_features", [16, 37, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_is_the_layers_output_through_gelu(kernel, rows, out_features, dtype):
    """The GELU (tanh) epilogue stores GELU of the sums as the layer outputs
    them (rounded to the dtype), in float32, rounded once: against torch's
    GELU in float64 (in float32 it loses the far negative tail to
    cancellation in 0.5 x (1 + tanh(u)), -0.0 where the value is -3e-8; in
    float64 below ~1e-15); outputs not a multiple of a block, a bias or none."""
    g = torch.Generator().manual_seed(rows * 3 + out_features)
    in_features = 96
    x = (2 * torch.randn(rows, in_features, generator=g)).to(dtype)  # GELU's both sides
    weight = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)
    packed = kernel.pack(weight)
    for bias in (None, torch.randn(out_features, generator=g).to(dtype)):
        ours = linear_kernel.linear(x, packed, bias, out_features, linear_kernel.GELU_TANH)
        plain = linear_kernel.linear(x, packed, bias, out_features)
        expected = torch.nn.functional.gelu(plain.double(), approximate="tanh")
        assert ours.shape == (rows, out_features) and ours.dtype == dtype
        # float32: e^-2|u| in float32 errs by ~|2u| ulps (measured up to
        # 2.7e-6 relative, at x ~ -5: a value ~1e-7); bfloat16: one rounding more.
        tolerance = 5e-6 if dtype == torch.float32 else torch.finfo(dtype).eps / 2 + 5e-6
        assert ((ours.double() - expected).abs() <= tolerance * expected.abs() + 1e-14).all()
        if dtype == torch.bfloat16:  # rounding the same value but next to a boundary
            assert (ours == expected.to(dtype)).double().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_takes_any_leading_shape_and_strides(kernel, dtype):
    weight = torch.randn(48, 32).to(dtype)
    packed = kernel.pack(weight)
    x = torch.randn(3, 40, 5).to(dtype).transpose(1, 2)[..., :32]  # not contiguous
    out = linear_kernel.linear(x, packed, None, 48)
    assert out.shape == (3, 5, 48)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    assert (out.double() - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


@pytest.mark.parametrize("gated", [linear_kernel.PLAIN, linear_kernel.GATED_SILU],
                         ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_are_not_multiplied(kernel, dtype, gated):
    """With 37 live rows of 48 a tensor of 48 rows gets its first 37 as ever
    (bit for bit) and zeros after (not computed); other row counts run
    whole, and so does everything once it is left."""
    torch.manual_seed(0)
    gate, up = torch.randn(40, 64).to(dtype), torch.randn(40, 64).to(dtype)
    packed = (kernel.pack_gated(gate, up)[0] if gated
              else kernel.pack(torch.cat([gate, up])))
    out_features = 40 if gated else 80
    x = torch.randn(1, 48, 64).to(dtype)
    whole = linear_kernel.linear(x, packed, None, out_features, gated)
    assert whole[:, 37:].abs().amin() > 0  # rows a computation would fill
    with set_forward_context(get_forward_context().padded(48, 37)):
        padded = linear_kernel.linear(x, packed, None, out_features, gated)
        other = linear_kernel.linear(x[:, :40], packed, None, out_features, gated)
    assert torch.equal(padded[:, :37], whole[:, :37])
    assert not padded[:, 37:].any()
    assert torch.equal(other, whole[:, :40])
    assert torch.equal(linear_kernel.linear(x, packed, None, out_features, gated), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_graph_shared_by_two_layers(kernel, dtype):
    """One inductor graph, the packed weights graph inputs: each layer its own result."""
    layers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        layers.append(nn.Linear(64, 100).to(dtype))
    packed = [PackedLinear(layer, kernel) for layer in layers]
    assert all(p.by_kernel for p in packed)

    def block(module, x):
        return torch.relu(module(x)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", dynamic=False, fullgraph=True)
    x = torch.randn(1, 9, 64).to(dtype)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    with torch.inference_mode():
        for layer, module in zip(layers, packed):
            expected = block(layer, x).float()
            got = compiled(module, x).float()
            assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("approximate, w1_by_kernel", [("none", False), ("tanh", True)])
def test_a_fused_activation_runs_by_the_kernel_only_where_it_has_it(kernel, approximate,
                                                                    w1_by_kernel):
    """A feed-forward block's first layer with exact GELU keeps oneDNN (its
    post-op runs the activation); with GELU's tanh approximation it runs by
    the kernel (its epilogue), an encoder's too; every other layer runs by
    the kernel, and the block computes what it did."""
    from fms.modules.feedforward import FeedForwardBlock

    x = torch.randn(2, 13, 48)
    for decoder, w2_by_kernel in ((nn.Module(), False), (None, True)):  # an encoder's, a decoder's
        torch.manual_seed(0)
        block = FeedForwardBlock(48, hidden_grow_factor=2.0,
                                 activation_fn=nn.GELU(approximate=approximate),
                                 use_bias=True).eval()
        with torch.inference_mode():
            expected = block(x)
            assert pack_linear_layers(block, kernel, decoder=decoder) == 2
            assert block.w1.by_kernel == w1_by_kernel
            assert block.w1.post_op == ("gelu", approximate)
            assert block.w2.by_kernel == w2_by_kernel and block.w2.post_op[0] == "none"
            assert (block(x) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_odd_bfloat16_inputs_stay_onednn(kernel):
    """bfloat16 multiplies pairs along the input: an odd input size keeps
    oneDNN (or, where oneDNN packs no bfloat16, torch's own linear)."""
    from vllm_accel import compat

    if torch.bfloat16 not in kernel.dtypes:
        pytest.skip("bfloat16 needs AVX-512 BF16")
    model = nn.Sequential(nn.Linear(33, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    assert pack_linear_layers(model, kernel) == (2 if compat.onednn_packs_dtype(torch.bfloat16) else 1)
    assert not getattr(model[0], "by_kernel", False) and model[1].by_kernel
    assert PackedLinear(nn.Linear(33, 8), kernel).by_kernel  # float32 takes any size


def _encoder_and_decoder(encoder_gelu: str):
    """A bfloat16 model of two parts: an encoder (a feed-forward block with
    GELU ``encoder_gelu``, then Linear(32, 33)) and a decoder (Linear(33, 32):
    an odd input size, then a block with exact GELU); its input and a
    function running it."""
    from fms.modules.feedforward import FeedForwardBlock

    torch.manual_seed(0)

    def block(approximate):
        return FeedForwardBlock(32, hidden_grow_factor=2, multiple_of=1,
                                activation_fn=nn.GELU(approximate=approximate), use_bias=True)

    model = nn.ModuleDict({"encoder": nn.Sequential(block(encoder_gelu), nn.Linear(32, 33)),
                           "decoder": nn.Sequential(nn.Linear(33, 32), block("none"))})
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    return model, lambda: model["decoder"](model["encoder"](x))


def test_bfloat16_where_onednn_packs_none_runs_by_the_kernel_alone(kernel, monkeypatch):
    """A CPU with AVX2 alone: oneDNN packs no bfloat16, so the layers our
    kernel runs are packed for it, an encoder's too and with SigLIP's GELU
    fused (exact GELU's layer runs plain, its GELU after); a layer of an odd
    input size stays torch's nn.Linear; the model computes what it did."""
    from vllm_accel import compat

    if torch.bfloat16 not in kernel.dtypes:
        pytest.skip("bfloat16 needs AVX-512 BF16 or AVX2")
    monkeypatch.setattr(compat, "onednn_packs_dtype", lambda dtype: dtype == torch.float32)
    model, run = _encoder_and_decoder("tanh")
    with torch.inference_mode():
        expected = run()
        # all but Linear(33, 32)
        assert pack_linear_layers(model, kernel, decoder=model["decoder"]) == 5
        tanh_block, exact_block = model["encoder"][0], model["decoder"][1]
        assert tanh_block.w1.by_kernel and tanh_block.w1.post_op == ("gelu", "tanh")
        assert isinstance(tanh_block.a, nn.Identity) and tanh_block.w2.by_kernel
        assert model["encoder"][1].by_kernel  # an encoder's plain layer: ours
        assert type(model["decoder"][0]) is nn.Linear  # odd input size
        assert exact_block.w1.by_kernel and exact_block.w1.post_op == ("none", "")
        assert isinstance(exact_block.a, nn.GELU) and exact_block.w2.by_kernel
        assert (run().float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("widened, on_amx", [(True, False), (False, True), (False, False)])
def test_bfloat16_widened_or_on_amx_runs_by_the_kernel_wherever_it_can(kernel, monkeypatch,
                                                                       widened, on_amx):
    """Where oneDNN packs bfloat16 and our kernel widens it (AVX-512 without
    BF16: oneDNN's is emulated there) or multiplies it on AMX tiles, our
    kernel runs every layer it can, an encoder's too, and a GELU it has no
    epilogue for runs after it, not as oneDNN's post-op; where the kernel
    multiplies bfloat16 by AVX-512 BF16, an encoder's plain layers and a
    layer with that GELU stay oneDNN's. Outputs as unpacked either way."""
    from vllm_accel import compat

    if torch.bfloat16 not in kernel.dtypes or not compat.onednn_packs_dtype(torch.bfloat16):
        pytest.skip("needs bfloat16 in both our kernel and oneDNN")
    monkeypatch.setattr(kernel, "widens_bfloat16", widened)
    monkeypatch.setattr(kernel, "multiplies_on_amx", on_amx)
    everywhere = widened or on_amx
    model, run = _encoder_and_decoder("none")
    with torch.inference_mode():
        expected = run()
        assert pack_linear_layers(model, kernel, decoder=model["decoder"]) == 6  # oneDNN packs the rest
        encoder_block, decoder_block = model["encoder"][0], model["decoder"][1]
        assert model["encoder"][1].by_kernel == everywhere  # an encoder's plain layer
        assert not model["decoder"][0].by_kernel  # odd input size: oneDNN's
        for block in (encoder_block, decoder_block):  # exact GELU: no epilogue of ours
            assert block.w1.by_kernel == everywhere  # else oneDNN's, with its post-op
            assert block.w1.post_op == (("none", "") if block.w1.by_kernel else ("gelu", "none"))
            assert isinstance(block.a, nn.GELU) == block.w1.by_kernel
        assert (run().float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


@pytest.mark.parametrize("amx", [False, True], ids=["avx512_bf16", "amx"])
def test_bfloat16_on_amx_only_by_kernels_that_multiply_on_its_tiles(tmp_path, monkeypatch, amx):
    """On a CPU with AMX, a kernel runs bfloat16 only if it multiplies on AMX
    tiles (the linear and span attention kernels built for such a CPU do; a
    kernel of AVX-512 BF16 dot products leaves bfloat16 to oneDNN or torch's
    SDPA); float32 stays ours."""
    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16", "amx_tile"} if amx else set())
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    kernels = []
    for module in (linear_kernel, span_attention):
        kernels.append(module.load(tmp_path))
        if kernels[-1] is None or torch.bfloat16 not in kernels[-1].runs:
            pytest.skip("the kernels' bfloat16 needs AVX-512 BF16")
    linear, span = kernels
    both, f32 = {torch.float32, torch.bfloat16}, {torch.float32}
    linear_tiles, span_tiles = (not amx or kernel.multiplies_on_amx for kernel in kernels)
    assert linear.dtypes == (both if linear_tiles else f32)
    assert span.dtypes == (both if span_tiles else f32)
    assert PackedLinear(nn.Linear(64, 8).to(torch.bfloat16), linear).by_kernel == linear_tiles
    assert PackedLinear(nn.Linear(64, 8), linear).by_kernel
    with set_forward_context(ForwardContext(kernels=CpuKernels(span=span))):
        assert (span_attention.supported(torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16))
                == span_tiles)
        assert span_attention.supported(torch.zeros(1, 4, 2, 64))

    class DotProductsOnly(span_attention.SpanAttentionKernel):
        def __init__(self, library):
            super().__init__(library)
            self.multiplies_on_amx = False

    dot_products = cpu_kernels.load(DotProductsOnly, span_attention.SOURCE, tmp_path, "SDPA")
    assert dot_products.dtypes == (f32 if amx else both)


def test_a_build_without_a_dtype_runs_none_of_it(tmp_path, monkeypatch):
    """A build without the vector instructions a dtype needs reports no
    layout for it (0 columns a block): the kernel loads and runs none of it
    (the probe of such a dtype divided by zero: an AVX-512 CPU without BF16
    could not start an engine before its bfloat16 was widened)."""
    monkeypatch.setattr(cpu_kernels, "COMPILE_FLAGS",
                        [*cpu_kernels.COMPILE_FLAGS, "-mno-avx512f", "-mno-avx2"])
    kernel = linear_kernel.LinearKernel(cpu_kernels.build(linear_kernel.SOURCE, tmp_path))
    assert kernel.layout(torch.float32)[0] == kernel.layout(torch.bfloat16)[0] == 0
    assert kernel.runs == set() and not kernel.widens_bfloat16


def test_an_encoders_layers_stay_onednn(kernel):
    """Only the decoder's layers run by the kernel (an encoder's thousands of
    rows are oneDNN's); the model computes what it did."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"encoder": nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)),
                           "decoder": nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))})
    x = torch.randn(5, 32)

    def run():
        return model["decoder"](model["encoder"](x))

    with torch.inference_mode():
        expected = run()
        assert pack_linear_layers(model, kernel, decoder=model["decoder"]) == 4
        assert [layer.by_kernel for layer in model["encoder"]] == [False, False]
        assert [layer.by_kernel for layer in model["decoder"]] == [True, True]
        assert (run() - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_with_avx2_alone_float32_stays_onednn(tmp_path, monkeypatch):
    """A build for AVX2 alone (8 lanes a vector) runs bfloat16 only, which
    oneDNN cannot pack there; float32 stays oneDNN's, faster than ours there."""
    real_load = cpu_kernels.load

    def load_as_avx2(*args):
        kernel = real_load(*args)
        kernel.vector_lanes = 8
        return kernel

    monkeypatch.setattr(cpu_kernels, "load", load_as_avx2)
    kernel = linear_kernel.load(tmp_path)
    assert torch.float32 in kernel.runs and torch.float32 not in kernel.dtypes
    assert not PackedLinear(nn.Linear(64, 8), kernel).by_kernel
    assert linear_kernel.runs(kernel, torch.bfloat16) == (torch.bfloat16 in kernel.runs)


@pytest.mark.parametrize("epilogue", [linear_kernel.PLAIN, linear_kernel.GATED_SILU,
                                      linear_kernel.GELU_TANH], ids=["plain", "gated", "gelu"])
@pytest.mark.parametrize("where", ["x", "weight"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_x_or_weight_propagates_as_in_torch(kernel, dtype, where, epilogue):
    """A NaN in one input row (or one weight row) makes exactly the outputs
    torch's linear and activation make NaN: that row's (that column's), with
    every epilogue, rows and columns past the kernel's blocks included."""
    rows, in_features, out_features = 37, 96, 80
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) / 10).to(dtype)
    if where == "x":
        x[5, 7] = float("nan")
    else:
        weight[11, 3] = float("nan")
    sums = torch.nn.functional.linear(x.double(), weight.double())
    if epilogue == linear_kernel.GATED_SILU:
        gate, up = weight.split(out_features // 2)
        packed, outputs = kernel.pack_gated(gate, up)[0], out_features // 2
        gate_sums, up_sums = sums.split(out_features // 2, dim=1)
        expected = torch.nn.functional.silu(gate_sums) * up_sums
    else:
        packed, outputs = kernel.pack(weight), out_features
        expected = (torch.nn.functional.gelu(sums, approximate="tanh")
                    if epilogue == linear_kernel.GELU_TANH else sums)
    ours = linear_kernel.linear(x, packed, None, outputs, epilogue)
    assert expected.isnan().any()
    assert torch.equal(ours.isnan(), expected.isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(ours.double()[finite], expected[finite], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_inf_in_x_gives_what_torch_gives(kernel, dtype):
    """An infinite input gives infinite (or NaN, where +inf meets -inf or a
    zero weight) outputs exactly where torch's linear does."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 64, generator=g).to(dtype)
    weight = torch.randn(48, 64, generator=g).to(dtype)
    x[2, 10], x[4, 3], x[4, 20] = float("inf"), float("inf"), float("-inf")
    ours = linear_kernel.linear(x, kernel.pack(weight), None, 48)
    expected = torch.nn.functional.linear(x.double(), weight.double())
    assert torch.equal(ours.isnan(), expected.isnan())
    assert torch.equal(ours.isinf(), expected.isinf())
    assert torch.equal(ours[ours.isinf()].sign().double(), expected[expected.isinf()].sign())
