"""Prompt logprobs (what evaluation harnesses score log-likelihood with):
every prompt position within 1e-4 of HF transformers' log-softmax (float32),
also when prefill runs in chunks and when the prompt shares a cached prefix."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from helpers import running_llm
from test_generation import random_prompts

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

TOP = 3
TOLERANCE = 1e-4


def hf_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: log P(ids[i + 1] | ids[:i + 1]) rows from HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()  # Granite: scaled
    return torch.log_softmax(logits, dim=-1)


def check(prompt_logprobs, ids, reference):
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:]):
        # The prompt's own token is always there, plus the top TOP.
        assert ids[i + 1] in entry and TOP <= len(entry) <= TOP + 1
        top = reference[i].topk(TOP).indices.tolist()
        assert set(top) <= set(entry), (i, top, list(entry))
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(reference[i, token_id].item(), abs=TOLERANCE)
        # Its rank, up to tokens within the tolerance of it (near ties may order either way).
        own = reference[i, ids[i + 1]]
        lowest = int((reference[i] > own + TOLERANCE).sum()) + 1
        assert lowest <= entry[ids[i + 1]].rank <= int((reference[i] > own - TOLERANCE).sum()) + 1


# Each layer kind once: attention (Llama), windows with sinks and Granite's
# multipliers (Granite SWA), experts (Mixtral), recurrent state (Bamba: no
# prefix cache, every prompt computed whole).
@pytest.mark.parametrize("arch", ["llama", "granite_swa", "mixtral", "bamba"])
def test_prompt_logprobs_match_hf_chunked_and_after_a_prefix_hit(tiny_models, arch):
    model_dir = tiny_models[arch]
    shared = random_prompts([150], seed=21)[0]
    first, second = [shared + tail for tail in random_prompts([20, 35], seed=22)]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    # 64-token steps: each prompt's prefill runs in 3 chunks.
    with running_llm(model_dir, max_num_batched_tokens=64, max_num_seqs=4) as llm:
        warm = llm.generate([TokensPrompt(prompt_token_ids=first)],
                            SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert warm[0].outputs[0].token_ids  # the shared prefix is now cached
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in (first, second)],
                            params, use_tqdm=False)
    for out, ids in zip(outs, (first, second)):
        check(out.prompt_logprobs, ids, hf_prompt_logprobs(model_dir, ids))
