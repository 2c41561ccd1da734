"""The paged-attention op's contract: it declares that it writes both KV
caches, so a compiled graph that reads a cache after the op sees the write
(and inductor updates the caches in place instead of copying them)."""

from __future__ import annotations


import pytest
import torch

from helpers import in_forward
from vllm_accel.architectures import by_model_type
from vllm_accel.kernels import decode_attention as decode_kernel
from vllm_accel.model import paged_attention as paged_attention_module
from vllm_accel.model.paged_attention import PagedAttentionMetadata, PrefillChunk, paged_attention
from vllm_accel.testing.fixtures import SUPPORTED_ARCHS

pytestmark = pytest.mark.usefixtures("every_core")  # the kernels split work by threads
BLOCKS, BLOCK, KV_HEADS, HEADS, DIM = 4, 4, 2, 4, 16


def test_schema_declares_both_caches_mutated():
    schema = torch.ops.vllm_accel.paged_attention.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"key_cache", "value_cache"}


def _step():
    """Two decodes writing slots 5 and 9, each attending over its block."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, HEADS, DIM, generator=g)
    key = torch.randn(1, 2, KV_HEADS, DIM, generator=g)
    value = torch.randn(1, 2, KV_HEADS, DIM, generator=g)
    metadata = PagedAttentionMetadata(
        slot_mapping=torch.tensor([5, 9]),
        num_decodes=2,
        decode_block_table=torch.tensor([[1], [2]]),
        decode_context_lens=torch.tensor([2, 2]),
    )
    return query, key, value, metadata


def _attend_then_read_caches(query, key, value, key_cache, value_cache):
    out = paged_attention(query, key, value, key_cache, value_cache, 0.25)
    # Reads after the op: they must see the keys/values it wrote.
    return out, key_cache.sum(dim=(1, 2, 3)), value_cache[2, 1].clone()


@pytest.mark.parametrize("by_kernel", [False, True], ids=["index_copy", "kernel"])
def test_compiled_reads_after_the_op_see_its_writes(by_kernel, kernel_cache):
    """Without the decode kernel, torch's index_copy_ writes the caches; with
    it, the kernel library's store."""
    query, key, value, metadata = _step()
    kernel = decode_kernel.load(kernel_cache) if by_kernel else None
    compiled = torch.compile(_attend_then_read_caches, backend="inductor", fullgraph=True,
                             dynamic=False)
    results = {}
    for name, fn in (("eager", _attend_then_read_caches), ("inductor", compiled)):
        caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
        with in_forward(metadata, decode=kernel):
            results[name] = fn(query, key, value, *caches)
        # The caches passed in hold the new entries (written in place).
        torch.testing.assert_close(caches[0].view(-1, KV_HEADS, DIM)[[5, 9]], key[0])
        torch.testing.assert_close(caches[1].view(-1, KV_HEADS, DIM)[[5, 9]], value[0])
    (out_e, ksum_e, v_e), (out_c, ksum_c, v_c) = results["eager"], results["inductor"]
    assert ksum_e[1] != 0 and ksum_e[2] != 0 and torch.equal(v_e, value[0, 1])
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(ksum_c, ksum_e)
    torch.testing.assert_close(v_c, v_e)


@pytest.mark.parametrize("with_prompt", [False, True], ids=["decodes", "decodes+prompt"])
def test_padding_rows_are_zero(with_prompt, kernel_cache, monkeypatch):
    """Rows past the step's decodes and chunks (a token bucket's padding) come
    out zero, not uninitialized memory (filled with NaN here); a prompt's
    chunk after the decodes moves where the padding starts."""
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    query, key, value, metadata = _step()
    pad = lambda t: torch.cat([t, torch.ones_like(t), torch.ones_like(t)], dim=1)  # 4 more
    metadata.slot_mapping = torch.tensor([5, 9, 13, 14, 0, 0])
    if with_prompt:  # tokens 2-3: a prompt's first two tokens
        metadata.prefills = [PrefillChunk(start=2, end=4)]
    filled = 4 if with_prompt else 2
    assert metadata.tokens == filled
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
    with torch.inference_mode(), in_forward(metadata, decode=decode_kernel.load(kernel_cache)):
        torch.use_deterministic_algorithms(True)
        try:
            out = paged_attention(pad(query), pad(key), pad(value), *caches, 0.25)
        finally:
            torch.use_deterministic_algorithms(False)
    assert out.shape == (1, 6, HEADS, DIM) and out[0, :filled].isfinite().all()
    assert out[0, :filled].abs().sum() > 0
    assert torch.equal(out[0, filled:], torch.zeros_like(out[0, filled:]))


def test_a_prompt_start_attends_causally_to_its_own_keys():
    """A chunk with no earlier context (no block table: SDPA's causal path on
    the new keys) gives what attending over its blocks in the cache gives."""
    from vllm_accel.model.paged_attention import causal_context_mask

    g = torch.Generator().manual_seed(1)
    tokens = 6  # positions 0..5 in blocks 1 and 2 (slots 4..9)
    query = torch.randn(1, tokens, HEADS, DIM, generator=g)
    key = torch.randn(1, tokens, KV_HEADS, DIM, generator=g)
    value = torch.randn(1, tokens, KV_HEADS, DIM, generator=g)
    slots = torch.arange(4, 4 + tokens)
    cached = PrefillChunk(0, tokens, torch.tensor([[1, 2]]), causal_context_mask(
        torch.arange(tokens)[None], torch.tensor([tokens]), 2 * BLOCK), context_len=tokens)
    outputs = []
    for chunk in (PrefillChunk(0, tokens), cached):
        caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
        with in_forward(PagedAttentionMetadata(slots, 0, prefills=[chunk])):
            outputs.append(paged_attention(query, key, value, *caches, 0.25))
        torch.testing.assert_close(caches[0].view(-1, KV_HEADS, DIM)[slots], key[0])
    torch.testing.assert_close(outputs[0], outputs[1])
    assert outputs[0].abs().sum() > 0


def test_bfloat16_prompts_attend_by_the_kernel(kernel_cache, with_bfloat16):
    """bfloat16 on a CPU with AVX-512 BF16: each prompt-start chunk of a forward
    (two prompts packed one after the other) attends by our span kernel,
    causally over its own keys, as SDPA does."""
    from vllm_accel.kernels import span_attention
    from vllm_accel.model.paged_attention import PrefillChunk

    kernel = with_bfloat16(span_attention.load(kernel_cache))
    g = torch.Generator().manual_seed(2)
    lengths = (7, 5)
    tokens = sum(lengths)
    query = torch.randn(1, tokens, HEADS, DIM, generator=g).bfloat16()
    key, value = (torch.randn(1, tokens, KV_HEADS, DIM, generator=g).bfloat16() for _ in range(2))
    chunks = [PrefillChunk(0, lengths[0]), PrefillChunk(lengths[0], tokens)]
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2)]
    calls = kernel.calls
    with in_forward(PagedAttentionMetadata(torch.arange(tokens), 0, prefills=chunks), span=kernel):
        out = paged_attention(query, key, value, *caches, 0.25)
    assert kernel.calls == calls + 2
    for chunk in chunks:
        rows = slice(chunk.start, chunk.end)
        expected = span_attention.reference(query[:, rows], key[:, rows], value[:, rows], 0.25,
                                            causal=True)
        torch.testing.assert_close(out[:, rows], expected, atol=2 ** -6, rtol=2 ** -7)

    # The first prompt's next chunk (3 tokens, positions 7..9) over its blocks
    # in the cache (slots 0..6 written above, its own go to 7..9): the kernel
    # as the masked SDPA over the gathered blocks gives.
    from vllm_accel.model.paged_attention import causal_context_mask

    more = [torch.randn(1, 3, h, DIM, generator=g).bfloat16() for h in (HEADS, KV_HEADS, KV_HEADS)]
    positions = torch.arange(7, 10)
    table = torch.tensor([[0, 1, 2]])
    chunk = PrefillChunk(0, 3, table, causal_context_mask(positions[None], torch.tensor([10]),
                                                          3 * BLOCK), context_len=10)
    with in_forward(PagedAttentionMetadata(positions, 0, prefills=[chunk]), span=kernel):
        got = paged_attention(*more, *caches, 0.25)
    assert kernel.calls == calls + 3
    keys, values = (c.view(1, -1, KV_HEADS, DIM)[:, :10] for c in caches)
    expected = span_attention.reference(more[0], keys, values, 0.25, causal=True)
    torch.testing.assert_close(got, expected, atol=2 ** -6, rtol=2 ** -7)
    assert torch.equal(keys[0, 7:], more[1][0])


def _hf_sink_attention(query, keys, values, mask, scale, sinks):
    """HF transformers' own eager attention of Granite SWA (its sinks as a
    post-softmax scale): query [1, heads, q, dim], keys/values [1, kv_heads,
    k, dim], mask bool [1, 1, q, k]."""
    from torch import nn
    from transformers.models.granite_swa.modeling_granite_swa import eager_attention_forward

    module = nn.Module()
    module.sinks, module.num_key_value_groups = sinks, query.shape[1] // keys.shape[1]
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    out, _ = eager_attention_forward(module, query, keys, values, additive, scale)
    return out  # [1, q, heads, dim]


def test_sinks_join_the_softmax_as_hfs_eager_attention_computes(kernel_cache):
    """Layers with attention sinks (a logit per head in the softmax's
    denominator only) attend by PyTorch, not our kernels, and equal HF's
    formula: a prompt's start (causal over its own keys), a chunk over its
    blocks with a window, decodes (one of them past the window); with sinks
    of -inf (no sink) they equal attention without sinks."""
    from vllm_accel.model.paged_attention import causal_context_mask

    g = torch.Generator().manual_seed(3)
    sinks = torch.tensor([2.0, -1.0, 0.5, 1.5])
    tokens = 6
    query = torch.randn(1, tokens, HEADS, DIM, generator=g)
    key, value = (torch.randn(1, tokens, KV_HEADS, DIM, generator=g) for _ in range(2))
    caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
    kernel = decode_kernel.load(kernel_cache)
    layout = PagedAttentionMetadata(torch.arange(4, 4 + tokens), 0,
                                    prefills=[PrefillChunk(0, tokens)])
    with in_forward(layout, decode=kernel):
        got = paged_attention(query, key, value, *caches, 0.25, sinks)
        plain = paged_attention(query, key, value, *caches, 0.25, torch.full((HEADS,), -1e30))
        without = paged_attention(query, key, value, *caches, 0.25)
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None]
    expected = _hf_sink_attention(query.transpose(1, 2), key.transpose(1, 2),
                                  value.transpose(1, 2), causal, 0.25, sinks)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(plain, without)
    assert not torch.allclose(got, without, atol=1e-3)

    # Positions 6..8 of the same prompt over its blocks 1..2, window 4; then
    # two decodes: at position 9 (window 4: keys 6..9) and (another request
    # whose blocks are the same) at position 2.
    more = [torch.randn(1, 3, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    chunk = PrefillChunk(0, 3, torch.tensor([[1, 2, 3]]), causal_context_mask(
        torch.arange(6, 9)[None], torch.tensor([9]), 3 * BLOCK, window=4), context_len=9)
    with in_forward(PagedAttentionMetadata(torch.arange(10, 13), 0, prefills=[chunk],
                                           window=4)):
        got = paged_attention(*more, *caches, 0.25, sinks)
    # The prompt's keys from slot 4 (block 1) on.
    keys, values = (c.view(1, -1, KV_HEADS, DIM)[:, 4:13].transpose(1, 2) for c in caches)
    expected = _hf_sink_attention(more[0].transpose(1, 2), keys, values,
                                  chunk.mask[..., :9], 0.25, sinks)
    torch.testing.assert_close(got, expected)

    decode = [torch.randn(1, 2, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    layout = PagedAttentionMetadata(
        torch.tensor([13, 6]), 2, decode_block_table=torch.tensor([[1, 2, 3], [1, 0, 0]]),
        decode_context_lens=torch.tensor([10, 3]), window=4, decodes_outrun_window=True)
    with in_forward(layout, decode=kernel):
        got = paged_attention(*decode, *caches, 0.25, sinks)
    keys, values = (c.view(1, -1, KV_HEADS, DIM).transpose(1, 2) for c in caches)
    for row, (lo, hi) in enumerate([(6, 10), (0, 3)]):
        visible = torch.zeros(1, 1, 1, keys.shape[2], dtype=torch.bool)
        visible[..., 4 + lo:4 + hi] = True  # the prompt's keys start at slot 4 (block 1)
        expected = _hf_sink_attention(decode[0][:, row:row + 1].transpose(1, 2), keys, values,
                                      visible, 0.25, sinks)
        torch.testing.assert_close(got[:, row:row + 1], expected)


def test_each_layer_reads_the_layout_of_its_group():
    """A forward holds a layout per KV cache group (slots, blocks, window of
    its own); the op takes the one its layer's group index names, and no
    index means the first."""
    g = torch.Generator().manual_seed(4)
    query = torch.randn(1, 1, HEADS, DIM, generator=g)
    key, value = (torch.randn(1, 1, KV_HEADS, DIM, generator=g) for _ in range(2))
    layouts = tuple(PagedAttentionMetadata(
        torch.tensor([slot]), 1, decode_block_table=torch.tensor([[slot // BLOCK]]),
        decode_context_lens=torch.tensor([1])) for slot in (4, 8))
    for group, slot in ((None, 4), (torch.tensor([0]), 4), (torch.tensor([1]), 8)):
        caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2)]
        with in_forward(layouts):
            out = paged_attention(query, key, value, *caches, 0.25, None, group)
        written = caches[0].view(-1, KV_HEADS, DIM).abs().sum(dim=(1, 2)).nonzero().flatten()
        assert written.tolist() == [slot]
        # One key of its own: each head's output is its value.
        torch.testing.assert_close(out[0, 0], value[0, 0].repeat_interleave(2, dim=0))


def test_a_layer_that_stores_its_keys_writes_the_caches_in_place_in_its_graph():
    """Given the slot mapping (``kv_slots``, as a GPU's forward passes it),
    FMS's store step writes the keys/values in the layer's own graph and the
    op only attends: the same outputs and caches as the op's own store, the
    write in one kernel with the keys' rotary, and the caches updated in
    place (no cache-sized buffer: a copy of every layer's cache a forward)."""
    from fms.modules.attention import MultiHeadAttention
    from fms.modules.positions import RotaryEmbedding
    from torch._inductor.utils import run_and_get_code

    from vllm_accel.model.paged_attention import ATTN_NAME, register_paged_attention

    register_paged_attention()
    torch.manual_seed(5)
    attn = MultiHeadAttention(HEADS * DIM, DIM, DIM, HEADS, KV_HEADS,
                              position_encoder=RotaryEmbedding(dim=DIM, max_seq_len=64)).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x, positions = torch.randn(1, 2, HEADS * DIM), torch.tensor([[5, 9]])
    # Two decodes: position 5 over blocks [1, 3] (slot 3 * 4 + 1), position
    # 9 over blocks [2, 5, 6] (slot 6 * 4 + 1).
    metadata = PagedAttentionMetadata(
        slot_mapping=torch.tensor([13, 25]), num_decodes=2,
        decode_block_table=torch.tensor([[1, 3, 0], [2, 5, 6]]),
        decode_context_lens=torch.tensor([6, 10]))
    blocks = 8

    def layer(x, positions, key_cache, value_cache, **store):
        out, _ = attn(x, position_ids=positions, past_key_value_state=(key_cache, value_cache),
                      use_cache=True, attn_name=ATTN_NAME, **store)
        return out

    def run(**store):
        g = torch.Generator().manual_seed(6)
        caches = [torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=g) for _ in range(2)]
        with torch.no_grad(), in_forward(metadata):
            if not store:
                return layer(x, positions, *caches), caches, ""
            torch._dynamo.reset()
            fn = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False)
            out, code = run_and_get_code(fn, x, positions, *caches, **store)
        return out, caches, "\n".join(code)

    out, caches, _ = run()
    stored_out, stored_caches, code = run(kv_slots=metadata.slot_mapping)
    torch.testing.assert_close(stored_out, out)
    for got, expected in zip(stored_caches, caches):
        torch.testing.assert_close(got, expected)
    kernels = [line.split("(")[0].strip() for line in code.splitlines()
               if line.strip().startswith("cpp_fused")]
    assert any("index_put" in k and "mul" in k for k in kernels), kernels
    # The op got the caches themselves (graph inputs) and was told they hold the keys.
    call = next(line for line in code.splitlines() if "paged_attention.default(" in line)
    assert call.rstrip().endswith("True)"), call
    assert f"empty_strided_cpu(({blocks}," not in code
    assert f"empty_strided_cpu(({blocks * BLOCK}," not in code


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHS
                                  if by_model_type(a).recurrent_state is None])
def test_every_architecture_passes_the_slots_to_its_store(arch, tmp_path, monkeypatch):
    """Where a layout lets the layers store (a GPU's), FMS's blocks of every
    architecture hand the forward's slot mapping to the store step: a prompt
    and then a decode that reads it back from the cache give the same hidden
    states and caches as the op's own store (eagerly, on the CPU)."""
    from transformers import AutoConfig

    from vllm_accel.model.fms_causal_lm import FmsCausalLM, load_fms_model
    from vllm_accel.testing.fixtures import make_tiny_model

    path = make_tiny_model(arch, tmp_path / arch)
    lm = FmsCausalLM(load_fms_model(str(path), AutoConfig.from_pretrained(path),
                                    torch.float32))
    block = 8
    prompt = PagedAttentionMetadata(  # 6 tokens at the prompt's start, into block 1
        slot_mapping=torch.arange(block, block + 6), num_decodes=0,
        prefills=[PrefillChunk(0, 6)])
    decode = PagedAttentionMetadata(  # the 7th token, over block 1
        slot_mapping=torch.tensor([block + 6]), num_decodes=1,
        decode_block_table=torch.tensor([[1]]), decode_context_lens=torch.tensor([7]))
    ids = torch.randint(0, 50, (1, 7), generator=torch.Generator().manual_seed(7))

    def run():
        caches = [tuple(torch.zeros(4, block, lm.num_kv_heads, lm.head_dim) for _ in range(2))
                  for _ in range(lm.num_layers)]
        with torch.no_grad():
            with in_forward(prompt):
                first = lm(ids[:, :6], torch.arange(6)[None], caches)
            with in_forward(decode):
                second = lm(ids[:, 6:], torch.tensor([[6]]), caches)
        return first, second, caches

    expected = run()
    told = []  # each op call's kv_stored: whether the layer's store step wrote

    def recording_op(*args):
        told.append(args[-1])
        return paged_attention(*args)

    monkeypatch.setattr(PagedAttentionMetadata, "stored_by_layers", property(lambda md: True))
    monkeypatch.setattr(paged_attention_module, "paged_attention", recording_op)
    got = run()
    assert told == [True] * (2 * lm.num_layers)
    for g, e in zip(got[:2], expected[:2]):
        torch.testing.assert_close(g, e)
    for layer_got, layer_expected in zip(got[2], expected[2]):
        for g, e in zip(layer_got, layer_expected):
            torch.testing.assert_close(g, e)
