"""LlavaNext (Granite Vision) only. Its parity with HF transformers'
LlavaNextForConditionalGeneration (each case, a mixed batch, a chunk boundary
inside an image, encoder counts, compiled serving) is in test_vision_parity.py,
its numbers in vision_cases.LLAVA_NEXT."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from helpers import running_llm
from vision_cases import LLAVA_NEXT, model_dir  # noqa: F401 (model_dir: a fixture)

pytestmark = pytest.mark.slow  # engines and servers: the full suite only


@pytest.fixture(scope="module")
def arch():
    return LLAVA_NEXT


def test_text_engine_after_a_vision_engine_keeps_no_image_state(model_dir, tiny_models):
    """A vision engine, then a text engine in the same process (a notebook, this
    suite): the text model's prompts may contain the vision model's image token
    id (6 is an ordinary token of the text tokenizer)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt

    with running_llm(model_dir, **LLAVA_NEXT.engine) as vision:
        with pytest.raises(VLLMValidationError, match="image token"):
            vision.generate(TokensPrompt(prompt_token_ids=[0, 6, 20, 21]),
                            SamplingParams(max_tokens=1), use_tqdm=False)
    with running_llm(tiny_models["llama"]) as text:
        out = text.generate(TokensPrompt(prompt_token_ids=[0, 6, 20, 21]),
                            SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
