"""The step layout on its own: no engine, no model. pack_step places decodes
first, then prefill chunks, and cuts the sequence into forwards padded to
token buckets; slots follow the block tables;
placeholder_rows (multimodal_rows) finds the image positions a step covers, also when a chunk
cuts through an image or only some positions take embeddings."""

from __future__ import annotations

import numpy as np
import torch

from vllm_accel.model.paged_attention import TableShape
from vllm_accel.worker.multimodal_rows import Placeholder, placeholder_rows
from vllm_accel.worker.step_layout import pack_step

BLOCK = 4


def _batch():
    """Three requests: row 0 prefills 6 tokens from 0, row 1 decodes at
    position 9, row 2 prefills a 3-token chunk from position 4."""
    token_ids = np.arange(3 * 16).reshape(3, 16) + 100  # token = 100 + 16*row + position
    block_table = np.array([[5, 6, 0, 0], [7, 8, 9, 0], [10, 11, 0, 0]])
    num_scheduled = np.array([6, 1, 3])
    start = np.array([0, 9, 4])
    return token_ids, block_table, num_scheduled, start


def _one_forward(bucket):
    return lambda n: [bucket]


def _pack(plan=_one_forward(16), context_bucket=lambda b: b):
    return pack_step(*_batch(), BLOCK, plan, context_bucket)


def test_decodes_first_then_prefill_chunks_then_padding():
    layout = _pack()
    assert layout.rows.tolist() == [1, 0, 2]
    assert layout.first_tokens.tolist() == [0, 1, 7] and layout.counts.tolist() == [1, 6, 3]
    assert layout.starts.tolist() == [9, 0, 4]
    ids = layout.input_ids[0].tolist()
    (forward,) = layout.forwards
    pos = forward.positions[0].tolist()
    assert ids == [116 + 9] + [100 + p for p in range(6)] + [132 + p for p in (4, 5, 6)]
    assert (forward.begin, forward.end, forward.bucket) == (0, 10, 16)
    assert pos == [9, 0, 1, 2, 3, 4, 5, 4, 5, 6] + [0] * 6  # padded to the bucket
    assert forward.input_ids[0].tolist() == ids + [0] * 6
    # Each request's last token, in packed order (rows 1, 0, 2): its logits.
    assert forward.logit_rows.tolist() == [0, 6, 9]


def test_slot_mapping_follows_block_tables_and_padding_writes_block_zero():
    slots = _pack().forwards[0].attn_metadata.slot_mapping.tolist()
    assert slots[0] == 9 * BLOCK + 1  # row 1, position 9: its third block (9), offset 1
    assert slots[1:7] == [20, 21, 22, 23, 24, 25]  # row 0: blocks 5, 6
    assert slots[7:10] == [44, 45, 46]  # row 2, positions 4-6: block 11
    assert slots[10:] == [0] * 6


def test_attention_metadata_masks():
    md = _pack(context_bucket=lambda blocks: 4).forwards[0].attn_metadata
    assert md.num_decodes == 1
    assert md.decode_block_table.tolist() == [[7, 8, 9, 0]]  # padded to 4 blocks
    assert md.decode_context_lens.tolist() == [10]  # row 1 decodes position 9
    first, second = md.prefills
    assert (first.start, first.end, second.start, second.end) == (1, 7, 7, 10)
    # Row 0's chunk starts its prompt: no earlier context, no blocks to read.
    assert first.block_table is None and first.mask is None
    assert second.block_table.tolist() == [[10, 11]]
    # Row 2's chunk at positions 4-6 sees the cached positions 0-3 and itself causally.
    assert second.mask.shape == (1, 1, 3, 8)
    assert second.mask[0, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]]


def test_a_sequence_table_has_a_fixed_shape_per_bucket():
    """The cuda layout: the same forwards as rows of query ranges, context
    lengths and blocks; a row per sequence a forward can hold (here the
    scheduler's 3, fewer than the 4 tokens), padding rows empty."""
    layout = pack_step(*_batch(), BLOCK, lambda n: [4, 4, 4], lambda blocks: 4,
                       table_shape=TableShape(max_sequences=3, width=3))
    first, second, third = (f.attn_metadata for f in layout.forwards)
    assert first.prefills == [] and first.decode_block_table is None
    # Row 1's decode (position 9: 10 keys), row 0's positions 0..2 (3 keys).
    table = first.sequences
    assert table.query_start.tolist() == [0, 1, 4, 4]
    assert table.seq_lens.tolist() == [10, 3, 0]
    assert table.block_table.tolist() == [[7, 8, 9], [5, 6, 0], [0, 0, 0]]
    assert first.num_decodes == 1
    # Row 0's positions 3..5 (6 keys), row 2's position 4 (5 keys).
    table = second.sequences
    assert table.query_start.tolist() == [0, 3, 4, 4]
    assert table.seq_lens.tolist() == [6, 5, 0]
    assert table.block_table[:2].tolist() == [[5, 6, 0], [10, 11, 0]]
    # The last forward: 2 of 4 tokens, row 2's positions 5..6 (7 keys).
    table = third.sequences
    assert table.query_start.tolist() == [0, 2, 2, 2] and table.seq_lens.tolist() == [7, 0, 0]
    assert [md.slot_mapping.tolist() for md in (first, second, third)] == [
        [37, 20, 21, 22], [23, 24, 25, 44], [45, 46, 0, 0]]
    # A bucket smaller than the scheduler's limit: one row per token.
    (forward,) = pack_step(*_batch(), BLOCK, lambda n: [16], lambda blocks: 4,
                           table_shape=TableShape(max_sequences=64, width=3)).forwards
    assert forward.attn_metadata.sequences.seq_lens.tolist() == [10, 6, 7] + [0] * 13


def test_the_plan_is_asked_for_the_real_token_count():
    asked = []
    layout = _pack(plan=lambda n: asked.append(n) or [n])
    assert asked == [10] and layout.input_ids.shape == (1, 10)


def test_forwards_cut_the_sequence_and_chunks_keep_their_context():
    """10 tokens as forwards of 4 + 4 + 2 (padded to 4): row 0's chunk (packed
    1..6) is cut twice; each piece attends to everything before it."""
    layout = _pack(plan=lambda n: [4, 4, 4], context_bucket=lambda blocks: 4)
    first, second, third = layout.forwards
    assert [(f.begin, f.end, f.bucket) for f in layout.forwards] == [(0, 4, 4), (4, 8, 4),
                                                                     (8, 10, 4)]
    # Forward 1: row 1's decode, then row 0's positions 0..2.
    md = first.attn_metadata
    assert md.num_decodes == 1 and md.decode_block_table.tolist() == [[7, 8, 9, 0]]
    (chunk,) = md.prefills
    assert (chunk.start, chunk.end, chunk.block_table) == (1, 4, None)  # the prompt's start
    assert first.positions[0].tolist() == [9, 0, 1, 2]
    # Forward 2: row 0's positions 3..5 (context 6: blocks 5 and 6), row 2's position 4.
    md = second.attn_metadata
    assert md.num_decodes == 0
    row0, row2 = md.prefills
    assert (row0.start, row0.end, row0.block_table.tolist()) == (0, 3, [[5, 6]])
    assert row0.mask[0, 0].int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    assert (row2.start, row2.end) == (3, 4)
    assert row2.mask[0, 0].int().tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert md.slot_mapping.tolist() == [23, 24, 25, 44]
    # Forward 3: the rest of row 2, then padding into block 0.
    assert third.attn_metadata.slot_mapping.tolist() == [45, 46, 0, 0]
    assert third.positions[0].tolist() == [5, 6, 0, 0]
    # Each forward computes the logits of the requests that end in it (row
    # 1's decode in the first; rows 0 and 2 end at packed 6 and 9).
    assert [f.logit_rows.tolist() for f in layout.forwards] == [[0], [2], [1]]
    assert third.input_ids[0].tolist() == [layout.input_ids[0, 8], layout.input_ids[0, 9], 0, 0]


def test_plan_forwards_pads_less_than_one_big_bucket():
    from vllm_accel.buckets import plan_forwards, token_count_costs

    buckets = [1, 4, 16, 64, 256, 1024]
    costs = token_count_costs(buckets, overhead=32)
    assert plan_forwards(256, buckets, costs) == [256]  # a bucket: exactly one forward
    assert plan_forwards(3, buckets, costs) == [4]
    assert sorted(plan_forwards(370, buckets, costs)) == [64, 64, 256]
    assert plan_forwards(2500, buckets, costs)[:2] == [1024, 1024]  # beyond the largest
    for total in range(1, 3000, 7):
        plan = plan_forwards(total, buckets, costs)
        assert all(b in buckets for b in plan)
        assert sum(plan[:-1]) < total <= sum(plan)  # every forward but the last is full


def test_plan_forwards_follows_measured_times():
    from vllm_accel.buckets import ForwardCosts, plan_forwards

    buckets = [1, 8, 16, 32, 48, 64, 256, 384, 512]
    # A GPU-like profile: a forward costs about the same up to 512 tokens.
    flat = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.15, 1.2)
    assert plan_forwards(300, buckets, ForwardCosts(flat, flat)) == [384]
    assert plan_forwards(40, buckets, ForwardCosts(flat, flat)) == [48]
    # A CPU-like profile, time growing with the tokens: 40 decodes run as
    # 32 + 8 when that is faster than padding to 48 ...
    steep = ForwardCosts.measured([1.0, 1.2, 1.5, 2.0, 3.3, 4.0, 15.0, 22.0, 29.0],
                                  [1.0, 1.2, 1.5, 2.0, 3.3, 4.0, 15.0, 22.0, 29.0])
    assert sorted(plan_forwards(40, buckets, steep)) == [8, 32]
    # ... and 300 tokens as 256 + 48 when the 384 forward costs more,
    assert sorted(plan_forwards(300, buckets, steep)) == [48, 256]
    # but not when going on after a cut costs more than starting.
    dear_later = ForwardCosts(steep.first, tuple(c + 8.0 for c in steep.later))
    assert plan_forwards(300, buckets, dear_later) == [384]


def test_measured_costs_never_favour_a_larger_bucket():
    from vllm_accel.buckets import ForwardCosts, plan_forwards

    costs = ForwardCosts.measured([2.0, 1.5, 3.0, 2.9, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert costs.first == (2.0, 2.0, 3.0, 3.0, 4.0)
    # The 16 bucket timed faster than the 8 one (noise): 5 tokens still pad to 8.
    noisy = ForwardCosts.measured([1.0, 2.0, 1.8], [1.0, 2.0, 1.8])
    assert plan_forwards(5, [1, 8, 16], noisy) == [8]


def test_placeholder_rows_whole_image_and_chunk_cut():
    layout = _pack()
    # Row 0 (prefill 0..5, packed 1..6) has an image at 2..9: this step covers 2..5.
    # Row 2 (chunk 4..6, packed 7..9) has an image at 1..4: covered at position 4 only.
    placeholders = [[Placeholder("a", 2, 8)], [], [Placeholder("b", 1, 4)]]
    is_mm, slices = placeholder_rows(layout, placeholders)
    assert np.flatnonzero(is_mm).tolist() == [3, 4, 5, 6, 7]
    assert slices == [("a", 0, 4), ("b", 3, 4)]


def test_placeholder_rows_with_non_embedding_positions():
    layout = _pack()
    # Row 0's span 1..6 takes embeddings at 1, 3, 4, 6 (others stay text); the
    # step covers positions 1..5 of it. Row 2's span 5..8 of which 5 and 8 embed:
    # the chunk covers 5..6.
    embed0 = np.array([True, False, True, True, False, True])
    embed2 = np.array([True, False, False, True])
    placeholders = [[Placeholder("a", 1, 6, embed0)], [], [Placeholder("b", 5, 4, embed2)]]
    is_mm, slices = placeholder_rows(layout, placeholders)
    # Packed index = first + position - start: row 0 first=1, start=0; row 2 first=7, start=4.
    assert np.flatnonzero(is_mm).tolist() == [2, 4, 5, 8]
    assert slices == [("a", 0, 3), ("b", 0, 1)]
    # A later chunk of row 2 starting at position 7 takes encoder row 1 only.
    token_ids, block_table, _, _ = _batch()
    later = pack_step(token_ids, block_table, np.array([1, 1, 2]), np.array([6, 9, 7]),
                      BLOCK, lambda n: [n], lambda b: b)
    is_mm, slices = placeholder_rows(later, [[], [], [Placeholder("b", 5, 4, embed2)]])
    assert np.flatnonzero(is_mm).tolist() == [3] and slices == [("b", 1, 2)]


def test_placeholder_rows_never_in_decode():
    layout = _pack()
    # Row 1 decodes at position 9; its image at 0..7 lies in the past.
    is_mm, slices = placeholder_rows(layout, [[], [Placeholder("c", 0, 8)], []])
    assert not is_mm.any() and slices == []
    assert isinstance(layout.forwards[0].positions, torch.Tensor)


def test_3d_rope_positions_from_the_prompt_then_by_delta():
    from vllm_accel.worker.step_layout import RopePositions

    # Row 0's prompt (6 tokens) has an image giving positions 1..2 on its axes;
    # rows 1 and 2 continue past their prompts with deltas -3 and 2.
    prompt0 = np.array([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])
    rope = [RopePositions(prompt0, -2),
            RopePositions(np.tile(np.arange(4), (3, 1)), -3),
            RopePositions(np.tile(np.arange(5), (3, 1)), 2)]
    layout = pack_step(*_batch(), BLOCK, _one_forward(12), lambda b: b, rope_positions=rope)
    (forward,) = layout.forwards
    assert forward.positions.shape == (3, 1, 12)
    pos = forward.positions[:, 0].numpy()
    assert pos[:, 0].tolist() == [6, 6, 6]  # row 1 decodes at 9: 9 - 3
    np.testing.assert_array_equal(pos[:, 1:7], prompt0)
    # Row 2's chunk 4..6: position 4 from its prompt, then 5 + 2 and 6 + 2.
    assert pos[:, 7:10].tolist() == [[4, 7, 8]] * 3
    assert not pos[:, 10:].any()
    # Attention still follows sequence order.
    assert forward.attn_metadata.prefills[1].mask.shape == (1, 1, 3, 8)


def test_forward_inputs_send_a_forward_in_one_buffer():
    """The cuda layout's inputs as one buffer (here in host memory): every
    view holds what the forward's own tensors hold, logit rows padded with
    row 0, and the tokens in flight that fall inside the forward."""
    from vllm_accel.worker.forward_inputs import ForwardInputs

    shape = TableShape(max_sequences=3, width=3)
    layout = pack_step(*_batch(), BLOCK, lambda n: [4, 4, 4], lambda blocks: 4,
                       table_shape=shape)
    staged = ForwardInputs(4, shape.rows(4), shape.width, 1, torch.device("cpu"))
    for forward in layout.forwards:
        sent = staged.send(forward, (np.array([0]), np.array([2])))
        table, got = forward.attn_metadata.sequences, sent.metadata[0].sequences
        assert torch.equal(sent.input_ids, forward.input_ids)
        assert torch.equal(sent.positions, forward.positions)
        assert torch.equal(sent.metadata[0].slot_mapping, forward.attn_metadata.slot_mapping)
        for name in ("query_start", "seq_lens", "block_table"):
            assert torch.equal(getattr(got, name), getattr(table, name)), name
        n = len(forward.logit_rows)
        assert sent.num_logits == n and sent.logit_rows[:n].tolist() == forward.logit_rows.tolist()
        assert sent.logit_rows[n:].tolist() == [0] * (3 - n)
        assert (sent.num_in_flight, sent.in_flight_targets[0], sent.in_flight_sources[0]) == (
            1, 0, 2)
    # The views are the buffer a captured graph reads: the same tensors each time.
    assert sent.input_ids.data_ptr() == staged.input_ids.data_ptr()
    # Each starts at 16 bytes (inductor copies an input that is not, each call).
    table = sent.metadata[0].sequences
    views = (sent.input_ids, sent.positions, sent.logit_rows, sent.in_flight_targets,
             sent.in_flight_sources, sent.metadata[0].slot_mapping, table.query_start,
             table.seq_lens, table.block_table)
    assert [(v.data_ptr() - sent.input_ids.data_ptr()) % 16 for v in views] == [0] * len(views)
    staged.clear()
    assert staged.metadata[0].slot_mapping.tolist() == [0] * 4
    assert staged.metadata[0].sequences.seq_lens.tolist() == [0] * 3


def test_forward_inputs_carry_recurrent_states_blocks_and_a_decode_graph_reads_them():
    """Models with recurrent layers: each segment's state block (per
    recurrent group) and flag go in the same buffer, padding rows on the null
    block 0; the layout a decode graph is captured with reads those views and
    records the clearing of a new request's state."""
    from vllm_accel.worker.forward_inputs import ForwardInputs

    shape = TableShape(max_sequences=4, width=3)
    layout = pack_step(*_batch(), BLOCK, _one_forward(16), lambda blocks: 4, table_shape=shape)
    (forward,) = layout.forwards
    state_tables = [np.array([[3], [4], [5]]), np.array([[13], [14], [15]])]
    recurrent = forward.recurrent_layout(state_tables)
    assert (recurrent.num_decodes, recurrent.starts, recurrent.ends) == (1, [0, 1, 7], [1, 7, 10])
    assert not recurrent.decodes_only
    staged = ForwardInputs(16, shape.rows(16), shape.width, 1, torch.device("cpu"),
                           state_groups=2)
    sent = staged.send(forward, (np.array([], dtype=np.int64),) * 2, recurrent)
    has_state, blocks = sent.recurrent.on(torch.device("cpu"))
    # Packed order: row 1's decode, row 0's prompt start, row 2's chunk.
    assert has_state.tolist() == [True, False, True, False]
    assert blocks.tolist() == [[4, 3, 5, 0], [14, 13, 15, 0]]
    graph = staged.decode_graph_layout()
    assert graph.decodes_only and graph.num_decodes == 4 and not graph.continues(0, 4)
    assert torch.equal(graph.on(torch.device("cpu"))[1], blocks)
    assert ForwardInputs(16, 4, 3, 1, torch.device("cpu")).decode_graph_layout() is None


def test_a_model_with_recurrent_layers_gets_graphs_up_to_the_bucket_of_all_its_decodes():
    """cuda: graphs of decodes only serve forwards of at most max_num_seqs
    tokens, so no larger bucket is captured; other models capture all."""
    from types import SimpleNamespace

    from vllm_accel.worker.cuda import graph_buckets

    def runner(recurrent, max_num_reqs):
        return SimpleNamespace(token_buckets=[1, 16, 512, 2048], max_num_reqs=max_num_reqs,
                               model=SimpleNamespace(recurrent={0: None} if recurrent else {}))

    assert graph_buckets(runner(True, 16)) == [1, 16]
    assert graph_buckets(runner(True, 17)) == [1, 16, 512]
    assert graph_buckets(runner(True, 4096)) == [1, 16, 512, 2048]
    assert graph_buckets(runner(False, 16)) == [1, 16, 512, 2048]


def test_the_memory_profile_fills_a_bucket_with_prompts_within_the_context():
    """cuda sizes its KV cache after a prefill forward of the largest token
    bucket; a bucket beyond max_model_len is several prompts, none reading a
    position past the model's context (one prompt of 8192 tokens read rotary
    positions past a 4096-position table: a device-side assert at start-up)."""
    from vllm_accel.worker.cuda import prefill_filling

    step, _, num_blocks = prefill_filling(600, 256, 32, TableShape(max_sequences=64, width=8))
    (forward,) = step.forwards
    assert (forward.begin, forward.end, forward.bucket) == (0, 600, 600)
    assert step.counts.tolist() == [256, 256, 88]
    assert int(forward.positions.max()) == 255
    slots = forward.attn_metadata.slot_mapping
    assert len(set(slots.tolist())) == 600 and int(slots.min()) >= 32  # never block 0
    assert num_blocks == 8 + 8 + 3 + 1
    assert forward.attn_metadata.sequences.seq_lens.tolist()[:4] == [256, 256, 88, 0]


def _two_groups(window: int = 3):
    """The batch's blocks in a full-attention group and, with blocks of its
    own (vLLM hands a block to one group at a time), a windowed one."""
    from vllm_accel.worker.step_layout import AttentionGroup

    token_ids, block_table, num_scheduled, start = _batch()
    other = np.where(block_table > 0, block_table + 20, 0)
    return (token_ids, [AttentionGroup(block_table), AttentionGroup(other, window)],
            num_scheduled, start)


def test_each_attention_group_has_its_slots_blocks_and_window():
    """Layers of several kinds (full, windowed) sit in KV cache groups with
    block tables of their own: each forward has a layout per group, whose
    slots follow its own blocks and whose masks its own window; the tokens,
    positions and chunks are the same."""
    layout = pack_step(*_two_groups(), BLOCK, _one_forward(16), lambda b: 4)
    (forward,) = layout.forwards
    full, windowed = forward.attention_layouts
    assert forward.attn_metadata is full
    assert full.window == 0 and windowed.window == 3
    assert windowed.slot_mapping[:10].tolist() == [s + 20 * BLOCK for s in
                                                   full.slot_mapping[:10].tolist()]
    assert windowed.slot_mapping[10:].tolist() == [0] * 6  # padding: the null block
    # Row 1's decode at position 9 (blocks 7, 8, 9): its window (7..9) starts in
    # its second block, so the windowed layout leaves the first out.
    assert full.decode_block_table.tolist() == [[7, 8, 9, 0]]
    assert full.decode_context_lens.tolist() == [10]
    assert windowed.decode_block_table.tolist() == [[28, 29, 0, 0]]
    assert windowed.decode_context_lens.tolist() == [6]
    assert windowed.decodes_outrun_window and not full.decodes_outrun_window
    assert [(c.start, c.end) for c in windowed.prefills] == [(c.start, c.end)
                                                            for c in full.prefills]
    # Row 2's chunk (positions 4..6): position 6 sees 4..6 in the window, 0..6 in full.
    assert windowed.prefills[1].mask[0, 0, 2].tolist()[:8] == [False] * 4 + [True] * 3 + [False]
    assert full.prefills[1].mask[0, 0, 2].tolist()[:8] == [True] * 7 + [False]
    # Row 0's prompt start (6 tokens) outruns the window: causal within it.
    assert full.prefills[0].mask is None and windowed.prefills[0].mask is not None


def test_forward_inputs_hold_each_attention_groups_slots_and_blocks():
    """cuda: one buffer per bucket holds every group's slots and block table
    (the queries and context lengths are the groups' alike), each group's
    layout its window."""
    from vllm_accel.worker.forward_inputs import ForwardInputs

    shape = TableShape(max_sequences=3, width=3)
    layout = pack_step(*_two_groups(), BLOCK, lambda n: [16], lambda blocks: 4,
                       table_shape=shape)
    staged = ForwardInputs(16, shape.rows(16), shape.width, 1, torch.device("cpu"), [0, 3])
    (forward,) = layout.forwards
    sent = staged.send(forward, (np.array([], dtype=np.int64),) * 2)
    assert [md.window for md in sent.metadata] == [0, 3]
    for got, want in zip(sent.metadata, forward.attention_layouts):
        assert torch.equal(got.slot_mapping, want.slot_mapping)
        for name in ("query_start", "seq_lens", "block_table"):
            assert torch.equal(getattr(got.sequences, name), getattr(want.sequences, name))
    assert not torch.equal(sent.metadata[0].slot_mapping, sent.metadata[1].slot_mapping)


def test_a_windowed_chunk_reads_from_the_first_block_its_window_reaches():
    """A chunk at positions 9..11 with a window of 3: its first query sees
    7..9, so its context starts at block 1 (positions 4..11); the mask is
    over those keys, and the blocks behind (freed by vLLM) are not read."""
    from vllm_accel.model.paged_attention import causal_context_mask

    token_ids = np.zeros((1, 16), dtype=np.int64)
    block_table = np.array([[5, 6, 7, 0]])
    (forward,) = pack_step(token_ids, block_table, np.array([3]), np.array([9]), BLOCK,
                           _one_forward(4), lambda b: b, window=3).forwards
    (chunk,) = forward.attn_metadata.prefills
    assert chunk.block_table.tolist() == [[6, 7]] and chunk.context_len == 8
    expected = causal_context_mask(torch.arange(9, 12)[None], torch.tensor([12]), 12, 3)
    assert torch.equal(chunk.mask, expected[..., 4:])
