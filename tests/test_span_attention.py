"""The CPU span-attention kernel against torch's SDPA (float64 reference),
through the op the towers and the prompts' paged attention call."""

from __future__ import annotations

import pytest
import torch

from helpers import in_forward
from vllm_accel.kernels import build as cpu_kernels
from vllm_accel.kernels import span_attention

CPU_FLAGS = cpu_kernels.cpu_flags() or set()
# bfloat16: by AVX-512 BF16 dot products (or AMX), or widened to float32 with AVX-512 BW.
BF16_RUNS = bool(CPU_FLAGS & {"avx512_bf16", "avx512bw"})
pytestmark = [pytest.mark.skipif("avx512f" not in CPU_FLAGS, reason="the kernel needs AVX-512"),
              pytest.mark.usefixtures("every_core")]
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_RUNS, reason="bfloat16 needs AVX-512 BF16 or BW")), torch.float32]


@pytest.fixture
def kernel(tmp_path_factory):
    """The kernel, running every dtype its build runs (AMX or not), in the
    forward context for the whole test."""
    kernel = span_attention.load(tmp_path_factory.mktemp("kernels"))
    assert kernel is not None
    kernel.dtypes = set(kernel.runs)
    with in_forward(span=kernel):
        yield kernel


def _errors(q, k, v, scale, ranges=None, causal=False, dtype=torch.bfloat16):
    """Mean and max error against float64, of the kernel and of SDPA, in ``dtype``."""
    reference = span_attention.reference(*(t.double() for t in (q, k, v)), scale, ranges,
                                         causal)
    inputs = [t.to(dtype) for t in (q, k, v)]
    got = span_attention.attend(*inputs, scale, ranges, causal)
    sdpa = span_attention.reference(*inputs, scale, ranges, causal)
    assert got.shape == q.shape and got.dtype == dtype
    return [((out.double() - reference).abs().mean().item(), (out.double() - reference).abs().max().item())
            for out in (got, sdpa)]


def _as_accurate_as_sdpa(errors, dtype):
    (mean, worst), (sdpa_mean, sdpa_worst) = errors
    if dtype == torch.bfloat16:  # one bfloat16 step at the outputs' size
        return mean <= 1.1 * sdpa_mean and worst <= sdpa_worst + 2 ** -7
    return mean <= 2 * sdpa_mean and worst <= 4 * sdpa_worst  # a few float32 ulps


@pytest.mark.parametrize("shape", [(2, 77, 4, 72), (3, 40, 2, 64), (1, 33, 2, 80), (1, 9, 1, 128),
                                   (2, 5, 3, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_is_as_accurate_as_sdpa(kernel, shape, dtype):
    """Head sizes of SigLIP (72), Molmo (64), Qwen2.5-VL (80) and others;
    token counts that are not multiples of the kernel's blocks."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    assert _as_accurate_as_sdpa(_errors(q, k, v, shape[-1] ** -0.5, dtype=dtype), dtype)


@pytest.mark.parametrize("tokens, heads, kv_heads, dim", [
    (128, 18, 6, 64), (77, 4, 4, 72), (40, 8, 2, 128), (1, 4, 1, 64), (300, 6, 3, 80)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_grouped_heads(kernel, tokens, heads, kv_heads, dim, dtype):
    """A prompt's attention: row r attends to keys 0..r, query heads in groups
    over fewer KV heads (the ~128M Llama's 18 over 6)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, tokens, heads, dim, generator=g)
    k, v = (torch.randn(1, tokens, kv_heads, dim, generator=g) for _ in range(2))
    assert _as_accurate_as_sdpa(_errors(q, k, v, dim ** -0.5, causal=True, dtype=dtype), dtype)
    # A later token's key never reaches an earlier row.
    half = [t.to(dtype) for t in (q, k, v)]
    before = span_attention.attend(*half, 0.1, causal=True)
    half[1][:, tokens // 2:] += 1
    after = span_attention.attend(*half, 0.1, causal=True)
    assert torch.equal(before[:, :tokens // 2], after[:, :tokens // 2])


def test_ranges_keep_rows_to_their_keys(kernel):
    """Segments (images, frames) and windows of a packed call: row r attends to
    keys ranges[r][0] .. ranges[r][1] - 1 only."""
    g = torch.Generator().manual_seed(1)
    bounds = [0, 70, 71, 150, 200]  # a one-token segment too
    starts = torch.cat([torch.full((e - s,), s) for s, e in zip(bounds, bounds[1:])])
    ends = torch.cat([torch.full((e - s,), e) for s, e in zip(bounds, bounds[1:])])
    ranges = torch.stack([starts, ends], -1).int()[None]
    q, k, v = (torch.randn(1, 200, 2, 80, generator=g) for _ in range(3))
    (mean, worst), (sdpa_mean, sdpa_worst) = _errors(q, k, v, 0.1, ranges)
    assert mean <= 1.1 * sdpa_mean and worst <= sdpa_worst + 2 ** -7
    # Changing another segment's keys leaves a segment's rows as they were.
    half = [t.bfloat16() for t in (q, k, v)]
    before = span_attention.attend(*half, 0.1, ranges)
    half[1][:, 150:] += 1
    half[2][:, 150:] += 1
    after = span_attention.attend(*half, 0.1, ranges)
    assert torch.equal(before[:, :150], after[:, :150])
    assert not torch.equal(before[:, 150:], after[:, 150:])
    # Spans of any integer dtype (the kernel reads int32).
    assert torch.equal(span_attention.attend(*half, 0.1, ranges.long()), after)


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_compiles_and_reads_spaced_tokens(kernel, dtype):
    """q, k, v as views of a fused projection; inside a compiled graph."""
    qkv = torch.randn(2, 50, 3, 4, 64).to(dtype)
    q, k, v = qkv.unbind(2)
    compiled = torch.compile(lambda q, k, v: span_attention.attend(q, k, v, 0.125) * 2,
                             fullgraph=True, backend="inductor")
    calls = kernel.calls
    torch.testing.assert_close(compiled(q, k, v), 2 * span_attention.reference(q, k, v, 0.125),
                               atol=2 ** -6, rtol=2 ** -7)
    assert kernel.calls == calls + 1


def test_kernel_runs_only_where_it_applies(kernel):
    single = torch.zeros(1, 4, 2, 63)
    assert span_attention.supported(single)  # float32: any head size up to 128
    assert not span_attention.supported(single.half())
    assert not span_attention.supported(torch.zeros(1, 4, 2, 256))
    if BF16_RUNS:
        assert span_attention.supported(torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16))
        assert not span_attention.supported(torch.zeros(1, 4, 2, 63, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_spans_by_sdpa_where_the_kernel_does_not_run(dtype):
    """Without the kernel for the dtype (bfloat16 on a CPU with AMX, a CPU
    without AVX-512) ``attend`` runs torch's SDPA over each run of rows with
    one span: the masked SDPA's result, runs of one shape batched (windows of
    4 rows, a partial one, images of 9 and 7; grouped query heads; in the
    second batch entry runs whose keys are not their own rows). Outside a
    forward's context no kernel runs."""
    g = torch.Generator().manual_seed(3)
    bounds = [0, 4, 8, 12, 14, 23, 30, 34]
    own = [(s, e) for s, e in zip(bounds, bounds[1:]) for _ in range(s, e)]
    # entry 1: rows 0-3 see keys 2-9, rows 4-7 keys 6-13 (same shape: one batch), the rest 20-33
    other = [(2, 10)] * 4 + [(6, 14)] * 4 + [(20, 34)] * 26
    ranges = torch.tensor([own, other], dtype=torch.int32)
    q = torch.randn(2, 34, 4, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 34, 2, 16, generator=g).to(dtype) for _ in range(2))
    got = span_attention.attend(q, k, v, 0.25, ranges)
    expected = span_attention.reference(q, k, v, 0.25, ranges)
    assert got.is_contiguous()
    tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    # One run's keys changed: only its rows change.
    k[0, 14:23] += 1
    after = span_attention.attend(q, k, v, 0.25, ranges)
    changed = (after != got).flatten(2).any(-1)
    assert changed[0, 14:23].all() and not changed[0, :14].any() and not changed[0, 23:].any()


@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_propagates_as_in_sdpa(kernel, where, causal, dtype):
    """A NaN in one query row, key or value makes NaN every output that
    attends to it (a query: its own row and head; a key: every dimension, a
    value: its own dimension, of each row that attends to that token, causal:
    the rows at and after it, in its KV head's group of query heads), and no
    output SDPA keeps finite. Bidirectional, that is exactly SDPA's NaN; a
    causal mask hides a NaN from earlier rows mathematically, but SDPA (masks
    added to scores, zero probabilities times a NaN value) and the kernel's
    blocks of rows and keys may still spread it there."""
    g = torch.Generator().manual_seed(4)
    tokens, heads, kv_heads, dim, token = 40, 4, 2, 64, 17
    q = torch.randn(1, tokens, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(1, tokens, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    target, head = {"query": (q, 1), "key": (k, 0), "value": (v, 0)}[where]
    target[0, token, head, 5] = float("nan")
    got = span_attention.attend(q, k, v, dim ** -0.5, causal=causal).isnan()
    sdpa = span_attention.reference(q, k, v, dim ** -0.5, causal=causal).isnan()
    attends = torch.zeros(got.shape, dtype=torch.bool)
    if where == "query":
        attends[0, token, head] = True
    else:
        rows = slice(token, None) if causal else slice(None)
        group = slice(head * heads // kv_heads, (head + 1) * heads // kv_heads)
        attends[0, rows, group, 5 if where == "value" else slice(None)] = True
    assert not (attends & ~sdpa).any()  # the reference itself
    assert not (attends & ~got).any(), "a NaN input vanished"
    assert not (got & ~sdpa).any(), "NaN where SDPA is finite"
    if not causal:
        assert torch.equal(got, sdpa)
