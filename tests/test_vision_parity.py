"""Vision-language models through our platform against HF transformers' own
model classes, token for token (float32), with vLLM's own processor expanding
the prompts: for each architecture in vision_cases.ARCHS (LlavaNext / Granite
Vision, Qwen2.5-VL), one image at sizes its processor handles differently, two
images, text only, a mixed batch, a chunk boundary inside an image, encoder
counts, and compiled serving with its vision buckets. What only one
architecture has stays in its own module (test_llava_next.py,
test_qwen2_5_vl.py)."""

from __future__ import annotations

import pytest

from helpers import (
    chat_prompt,
    hf_vision_greedy,
    model_runner,
    noise_image,
    running_llm,
    vision_greedy,
)
from vision_cases import (  # noqa: F401 (cases, expected, hf, llm, model_dir: fixtures)
    ARCHS,
    MAX_TOKENS,
    cases,
    expected,
    hf,
    llm,
    model_dir,
)


@pytest.fixture(scope="module", params=ARCHS, ids=lambda arch: arch.name)
def arch(request):
    return request.param


def test_each_case_matches_hf(llm, cases, expected):
    for case, want in zip(cases, expected):
        assert vision_greedy(llm, [case], MAX_TOKENS) == [want]


@pytest.mark.slow
def test_mixed_batch_equals_single_requests_and_hf(llm, cases, expected):
    batched = vision_greedy(llm, cases, MAX_TOKENS)
    assert batched == [vision_greedy(llm, [case], MAX_TOKENS)[0] for case in cases]
    assert batched == expected


@pytest.mark.slow
def test_images_of_a_step_share_encoder_calls(arch, llm, hf):
    """New images of every case size in one batch: packed into fewer encoder
    calls (arch.packed_batch), each output still HF's."""
    processor, _ = hf
    batch = [(chat_prompt(processor, 1, "Describe it."), [noise_image(*size, seed=7)])
             for size in arch.sizes]
    encoder = model_runner(llm).vision_encoder
    images, calls = encoder.images_encoded, encoder.calls
    assert vision_greedy(llm, batch, MAX_TOKENS) == \
        [hf_vision_greedy(hf, *case, MAX_TOKENS) for case in batch]
    assert (encoder.images_encoded - images, encoder.calls - calls) == arch.packed_batch


@pytest.mark.slow
def test_chunk_boundary_inside_an_image(arch, model_dir, hf):
    processor, _ = hf
    # Chunks of arch.chunk_tokens end inside the image (why: the table entry).
    case = (chat_prompt(processor, 1, "What is it?"), [noise_image(*arch.chunk_image, seed=3)])
    with running_llm(model_dir, max_num_batched_tokens=arch.chunk_tokens,
                     **arch.engine) as chunked:
        encoder = model_runner(chunked).vision_encoder
        before = encoder.images_encoded  # warmup images
        assert vision_greedy(chunked, [case], MAX_TOKENS) == \
            [hf_vision_greedy(hf, *case, MAX_TOKENS)]
        assert encoder.images_encoded - before == 1  # one image, encoded once across chunks


@pytest.mark.slow
def test_encoder_runs_once_per_distinct_image_never_in_decode(arch, llm, hf):
    processor, _ = hf
    encoder = model_runner(llm).vision_encoder
    width, height, seed = arch.repeat_image
    picture = noise_image(width, height, seed=seed)
    before = encoder.images_encoded
    case = (chat_prompt(processor, 1, "What colour dominates?"), [picture])
    # The same image twice in one batch: one encode; MAX_TOKENS (10) decode
    # steps: none.
    assert vision_greedy(llm, [case, case], MAX_TOKENS) == \
        [hf_vision_greedy(hf, *case, MAX_TOKENS)] * 2
    assert encoder.images_encoded - before == 1
    if arch.cached_followup is not None:
        # A later request with the same image and prompt prefix: vLLM reports
        # the image cached (prefix cache / encoder cache), so nothing is encoded.
        again = (chat_prompt(processor, 1, arch.cached_followup), [picture])
        assert vision_greedy(llm, [again], MAX_TOKENS) == \
            [hf_vision_greedy(hf, *again, MAX_TOKENS)]
        assert encoder.images_encoded - before == 1


@pytest.mark.slow
def test_compiled_serving_never_recompiles_across_image_sizes(arch, model_dir, cases, expected,
                                                              tmp_path):
    config = {"accel": {"compile_backend": "inductor", **arch.compile_settings,
                        "compile_cache_dir": str(tmp_path)}}
    with running_llm(model_dir, additional_config=config,
                     max_num_batched_tokens=arch.compile_batched_tokens,
                     **arch.engine) as compiled:
        runner = model_runner(compiled)
        if arch.vision_buckets is not None:
            assert runner.vision_encoder.buckets == arch.vision_buckets
        stats = runner.compile_stats
        assert stats.warmup_graphs == arch.warmup_graphs
        adapter = runner.vision_encoder.adapter
        units = adapter.vision_compile_units()
        # Warmup ran each vision bucket's graphs in the first layer of each
        # kind only (model.compile.warming_up); the rest passed through.
        ran = [unit.forward.guarded_calls > 0 for unit in units]
        assert sum(ran) == adapter.vision_graphs_per_bucket and ran[0]
        layers = [*runner.model.fms_model.base_model.layers, *units]
        guarded = [layer.forward.guarded_calls for layer in layers]
        got = vision_greedy(compiled, cases, MAX_TOKENS)
        assert stats.runtime_compiles == 0
        # Warmup made every kind of layer call: serving checks no dynamo guards.
        assert [layer.forward.guarded_calls for layer in layers] == guarded
    assert got == expected
