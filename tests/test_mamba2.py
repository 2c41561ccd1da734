"""Mamba2 layers over vLLM's paged recurrent state (model/mamba2.py), against
the references we did not write: HF transformers' chunked scan and FMS's own
Mamba2 mixer, which runs a whole sequence from a zero state."""

from __future__ import annotations

import pytest
import torch

from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.model import mamba2
from vllm_accel.model.mamba2 import PagedMamba2, RecurrentLayout
from vllm_accel.model.ssd_scan import chunked_scan

HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, CHUNK, EMB = 8, 16, 2, 16, 4, 8, 64


def _hf_scan(x, dt, A, B, C, chunk, state):
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    y, final = mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], chunk,
                                 initial_states=state[None], return_final_states=True)
    return y[0], final[0]


@pytest.mark.parametrize("length", [1, 7, 8, 9, 30])
def test_chunked_scan_equals_hf_from_any_state(length):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=g)
    dt = torch.rand(length, HEADS, generator=g) * 0.3
    A = -torch.rand(HEADS, generator=g) * 4
    B, C = (torch.randn(length, GROUPS, STATE, generator=g) for _ in range(2))
    state = torch.randn(HEADS, HEAD_DIM, STATE, generator=g)
    want_y, want_state = _hf_scan(x, dt, A, B, C, CHUNK, state)
    heads_B, heads_C = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (B, C))
    y, final = chunked_scan(x, dt, A, heads_B, heads_C, CHUNK, state)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)


def _fms_ssm(seed=0):
    from fms.modules.ssm import SSM

    ssm = SSM(nheads=HEADS, emb_dim=EMB, state_size=STATE, conv_kernel=KERNEL, expand=2.0,
              use_bias=False, use_conv_bias=True, activation_fn="silu", norm_eps=1e-5,
              n_groups=GROUPS, head_dim=HEAD_DIM, chunk_size=CHUNK)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ssm.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "conv" in name else 0.1))
        ssm.A_log.copy_(torch.log(torch.linspace(1, 8, HEADS)))
        ssm.dt_bias.copy_(torch.linspace(-4, -1, HEADS))
        ssm.D.fill_(1.0)
        ssm.norm.weight.fill_(1.0)
    return ssm.eval()


class Pages:
    """A recurrent layer's pages: 6 blocks, each half a page in one tensor
    and half in another (as the runner keeps them), a page holding its state."""

    def __init__(self, mixer: PagedMamba2, num_blocks=6):
        half = -(-mixer.state_shapes().nbytes // 2) + 64  # some slack
        self.state = (*(torch.zeros(num_blocks, half, dtype=torch.uint8) for _ in range(2)),
                      torch.tensor([0]))

    @property
    def backing(self) -> torch.Tensor:
        """A copy of both halves, [2, blocks, half]."""
        return torch.stack(self.state[:2])


def _run(mixer, pages, x, layout):
    with set_forward_context(ForwardContext(recurrent=layout)), torch.no_grad():
        return mixer(x[None], pages.state)[0]


def _layout(segments, blocks, has_state, num_decodes=0):
    return RecurrentLayout(num_decodes, [s for s, _ in segments], [e for _, e in segments],
                           torch.tensor(has_state), torch.tensor([blocks]))


@pytest.mark.parametrize("row_by_row", [True, False], ids=["cpu_decode", "gpu_decode"])
def test_packed_requests_continue_their_own_states_and_padding_touches_nothing(
        row_by_row, monkeypatch):
    """Two prompts packed in one forward (with padding rows), each from a zero
    state; then one chunk each, then decodes (one of a new one-token prompt):
    every token's output equals FMS's mixer over that request's whole
    sequence, and no other block's bytes change. The decodes' update as the
    cpu runs it (a request at a time) and as a GPU does (the batch at once)."""
    monkeypatch.setattr(mamba2, "ROW_BY_ROW_DEVICES", ("cpu",) if row_by_row else ())
    ssm = _fms_ssm()
    mixer = PagedMamba2(ssm)
    pages = Pages(mixer)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, EMB, generator=g) for n in (21, 13, 1)]
    with torch.no_grad():
        want = [ssm(s[None], None)[0][0] for s in seqs]
    untouched = pages.backing[:, [0, 4, 5]].clone()
    # Forward 1: prompt a rows 0-10, prompt b rows 11-16, 3 padding rows.
    x = torch.cat([seqs[0][:11], seqs[1][:6], torch.full((3, EMB), 7.0)])
    out = _run(mixer, pages, x, _layout([(0, 11), (11, 17)], [1, 2], [False, False]))
    torch.testing.assert_close(out[:11], want[0][:11], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[11:17], want[1][:6], atol=1e-5, rtol=1e-4)
    # Forward 2: the chunks go on (b first), crossing scan chunks.
    x = torch.cat([seqs[1][6:12], seqs[0][11:20]])
    out = _run(mixer, pages, x, _layout([(0, 6), (6, 15)], [2, 1], [True, True]))
    torch.testing.assert_close(out[:6], want[1][6:12], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[6:], want[0][11:20], atol=1e-5, rtol=1e-4)
    # Forward 3: decodes of a and b, and a new one-token prompt c (block 3,
    # whose stale bytes it must not read); one padding row.
    for half in pages.state[:2]:
        half[3] = 255
    x = torch.stack([seqs[0][20], seqs[1][12], seqs[2][0], torch.zeros(EMB)])
    out = _run(mixer, pages, x, _layout([(0, 1), (1, 2), (2, 3)], [1, 2, 3],
                                        [True, True, False], num_decodes=3))
    torch.testing.assert_close(out[0], want[0][20], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], want[1][12], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[2], want[2][0], atol=1e-5, rtol=1e-4)
    assert torch.equal(pages.backing[:, [0, 4, 5]], untouched)


@pytest.mark.parametrize("row_by_row", [True, False], ids=["cpu_decode", "gpu_decode"])
def test_a_decode_graphs_layout_gives_the_decodes_own_outputs_and_states(
        row_by_row, monkeypatch):
    """The layout a CUDA graph of decodes is captured with (a decode per
    table row; blocks and flags read from the forward's device inputs):
    decodes of two going requests and a new one-token prompt whose block
    holds stale bytes, then padding rows on the null block 0, give what the
    forward's own layout gives, and touch no block but theirs and block 0."""
    monkeypatch.setattr(mamba2, "ROW_BY_ROW_DEVICES", ("cpu",) if row_by_row else ())
    mixer = PagedMamba2(_fms_ssm(seed=8))
    g = torch.Generator().manual_seed(9)
    prompts = torch.randn(2, 5, EMB, generator=g)
    x = torch.cat([torch.randn(3, EMB, generator=g), torch.zeros(3, EMB)])
    results = []
    for graph in (False, True):
        pages = Pages(mixer)
        for row, block in enumerate((1, 2)):
            _run(mixer, pages, prompts[row], _layout([(0, 5)], [block], [False]))
        for half in pages.state[:2]:
            half[3] = 255
        untouched = pages.backing[:, [4, 5]].clone()
        if graph:  # 4 table rows: the 3 decodes, one padding row
            layout = RecurrentLayout.for_decode_graph(
                4, torch.tensor([1, 1, 0, 0]), torch.tensor([[1, 2, 3, 0]]))
        else:
            layout = _layout([(0, 1), (1, 2), (2, 3)], [1, 2, 3], [True, True, False],
                             num_decodes=3)
        out = _run(mixer, pages, x, layout)
        assert torch.equal(pages.backing[:, [4, 5]], untouched)
        results.append((out[:3], pages.backing[:, 1:4].clone()))
    # Equal up to rounding: a padding row can change the matmuls' blocking
    # (one float32 ulp on some CPUs); the states compared as the floats they
    # hold (a page's unused tail keeps its stale bytes: NaN in both).
    (out, state), (want_out, want_state) = results[1], results[0]
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state.view(torch.float32), want_state.view(torch.float32),
                               atol=1e-6, rtol=1e-5, equal_nan=True)


def test_a_restarted_request_starts_from_zero_state():
    """A preempted request is computed again from its first token: the chunk
    that starts its prompt ignores what its block holds."""
    ssm = _fms_ssm(seed=2)
    mixer = PagedMamba2(ssm)
    pages = Pages(mixer)
    x = torch.randn(12, EMB, generator=torch.Generator().manual_seed(3))
    first = _run(mixer, pages, x, _layout([(0, 12)], [1], [False]))
    again = _run(mixer, pages, x, _layout([(0, 12)], [1], [False]))  # block 1 holds a state
    assert torch.equal(first, again)


def test_bfloat16_state_and_float32_ssm_state_round_trip():
    """The SSM state may be kept in another dtype than the convolution's
    (vLLM's mamba_ssm_cache_dtype): both views fit their block's bytes."""
    ssm = _fms_ssm(seed=4)
    mixer = PagedMamba2(ssm)
    mixer.conv_dtype, mixer.ssm_dtype = torch.bfloat16, torch.float32
    pages = Pages(mixer)
    x = torch.randn(10, EMB, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ssm(x[None], None)[0][0]
    whole = _run(mixer, pages, x[:6], _layout([(0, 6)], [2], [False]))
    rest = _run(mixer, pages, x[6:], _layout([(0, 4)], [2], [True]))
    got = torch.cat([whole, rest])
    torch.testing.assert_close(got[:6], want[:6], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[6:], want[6:], atol=0.05, rtol=0.05)  # bf16 conv inputs


@pytest.mark.slow
def test_inductor_compiled_mixer_equals_eager_with_any_block_count():
    """The mixer compiled as the runner compiles layers (inductor, static
    shapes, the pages' block count dynamic): a prefill then a decode give
    eager's outputs and leave eager's states."""
    from vllm_accel.compat import any_size_along

    mixer = PagedMamba2(_fms_ssm(seed=6))
    x = torch.randn(13, EMB, generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(lambda h, state: mixer(h, state), backend="inductor",
                             fullgraph=True, dynamic=False)
    results = []
    for forward in (mixer, compiled):
        pages = Pages(mixer)
        for half in pages.state[:2]:
            any_size_along(half, 0)
        prefill = _run(forward, pages, x[:12], _layout([(0, 12)], [1], [False]))
        decode = _run(forward, pages, torch.stack([x[12], torch.zeros(EMB)]),
                      _layout([(0, 1)], [1], [True], num_decodes=1))
        results.append((prefill, decode, pages.backing.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)


def _engine_config(model_dir, **options):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model_dir), dtype="float32", max_model_len=512,
                      **options).create_engine_config()


def test_the_block_holds_a_state_and_prefix_caching_is_off(tiny_models):
    """vLLM's rules for hybrid models, as the platform applies them: an
    attention block grows (by the block size set) until its page holds a
    Mamba2 state, the state's page is padded to it, one state block per
    request (mamba_cache_mode "none"), and prefix caching is off."""
    # The tiny Bamba's state: 8 x 64 x 16 float32 SSM state (32768 bytes) and
    # 3 x 576 convolution inputs (6912); attention: 2 x 2 heads x 64, 1024
    # bytes a token.
    cache = _engine_config(tiny_models["bamba"]).cache_config
    assert (cache.block_size, cache.mamba_page_size_padded) == (64, 64 * 1024)
    assert not cache.enable_prefix_caching and cache.mamba_cache_mode == "none"
    assert cache.mamba_block_size == 512
    cache = _engine_config(tiny_models["bamba"], block_size=16).cache_config
    assert (cache.block_size, cache.mamba_page_size_padded) == (48, 48 * 1024)
    # Other models keep theirs.
    cache = _engine_config(tiny_models["llama"]).cache_config
    assert cache.block_size == 32 and cache.enable_prefix_caching


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "rope", "attention_only"])
def test_granite_4_variants_match_hf(tmp_path, monkeypatch, variant):
    """The Granite 4 fixture (experts beside a shared MLP, no position
    encoding, as granite-4.0-h-tiny) in its other forms: dense (no experts,
    granite-4.0-h-micro's form), with a rotary embedding (FMS's rotary in its
    attention layers), and with attention in every layer (no recurrent state:
    prefix caching stays on, no Mamba2 block size)."""
    from helpers import hf_greedy, model_runner, running_llm
    from test_generation import ENGINE_OPTIONS, MAX_TOKENS, generate, random_prompts

    from vllm_accel.testing import tiny_granite_hybrid

    make_config = tiny_granite_hybrid.granite_hybrid_config

    def config(tokenizer):
        hf = make_config(tokenizer, experts=0 if variant == "dense" else 4)
        if variant == "rope":
            hf.position_embedding_type = "rope"
            hf.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
        elif variant == "attention_only":
            hf.layer_types = ["full_attention"] * hf.num_hidden_layers
        return hf

    monkeypatch.setattr(tiny_granite_hybrid, "granite_hybrid_config", config)
    model_dir = tiny_granite_hybrid.make_tiny_granite_hybrid(tmp_path / variant)
    prompts = random_prompts([7, 150], seed=25)
    with running_llm(model_dir, **ENGINE_OPTIONS) as llm:
        runner = model_runner(llm)
        assert bool(runner.kv_cache.state_groups) == (variant != "attention_only")
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching == (
            variant == "attention_only")
        assert generate(llm, prompts) == hf_greedy(model_dir, prompts, MAX_TOKENS)
