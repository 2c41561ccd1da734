"""The pure prompt-logprobs planner: which positions of a step score which
prompt tokens, across chunked prefills."""

from __future__ import annotations

from vllm_accel.worker.prompt_logprobs import plan_chunk

PROMPT = [10, 11, 12, 13, 14, 15, 16]  # 7 tokens: 6 positions predict a prompt token


def test_whole_prompt_in_one_step():
    chunk = plan_chunk(PROMPT, num_computed=0, num_scheduled=7)
    assert chunk.positions == slice(0, 6)
    assert chunk.targets == PROMPT[1:]
    assert chunk.finished


def test_chunks_cover_every_position_once_and_finish_last():
    chunks, done = [], 0
    for size in (3, 3, 1):  # the last chunk holds only the last prompt token
        chunks.append(plan_chunk(PROMPT, done, size))
        done += size
    assert [c.positions for c in chunks] == [slice(0, 3), slice(3, 6), slice(6, 6)]
    assert [t for c in chunks for t in c.targets] == PROMPT[1:]
    assert [c.finished for c in chunks] == [False, False, True]
    assert chunks[-1].num_logits == 0


def test_chunk_ending_on_the_last_prompt_token_finishes():
    chunk = plan_chunk(PROMPT, num_computed=4, num_scheduled=3)
    assert chunk.positions == slice(4, 6) and chunk.targets == [15, 16]
    assert chunk.finished


def test_one_token_prompt_scores_nothing():
    chunk = plan_chunk([10], num_computed=0, num_scheduled=1)
    assert chunk.num_logits == 0 and chunk.targets == [] and chunk.finished
