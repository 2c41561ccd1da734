"""Configuration and request checks the platform makes, one function per
concern: each fails with a message naming the setting and what is allowed,
or sets what vLLM must know before it builds the engine (the recurrent
state's pages, the runner protocol, modalities limited to 0)."""

from __future__ import annotations

import os

from vllm_accel.compat import limit_modality_to_zero
from vllm_accel.devices import DeviceBackend
from vllm_accel.log import get_logger
from vllm_accel.patches import use_v1_model_runner

logger = get_logger(__name__)


def configure_recurrent_state(vllm_config, arch, dims, backend: DeviceBackend) -> None:
    """Layers that keep recurrent state (Mamba2) keep it in vLLM's hybrid KV
    cache: a KV cache group of them beside the attention layers', one block
    per request (vLLM's ``mamba_cache_mode`` "none"), in pages as large as an
    attention block's. As vLLM's own platforms do for hybrid models
    (``Platform._align_hybrid_block_size``), the attention block grows (to
    a multiple of the block size set) until its page holds a state, and the
    state's page is padded to it.

    Prefix caching is turned off: a cached prefix would need the recurrent
    state at its end, which vLLM keeps only in its "align" mode (states
    saved at block boundaries while prefilling), which the runner does not
    do. On cuda only forwards of decodes replay CUDA graphs: the layers'
    scan follows each forward's segments on the host
    (worker/cuda_graphs.py)."""
    from vllm_accel.compat import mamba2_state_dtypes
    from vllm_accel.model.mamba2 import StateShapes

    if backend.device not in ("cpu", "cuda"):
        raise ValueError(f"vllm-accel runs {arch.name}'s recurrent (Mamba2) layers on the cpu "
                         f"and cuda devices, not '{backend.device}'.")
    cache, model_config = vllm_config.cache_config, vllm_config.model_config
    if cache.enable_prefix_caching:
        logger.warning_once(
            "vllm-accel turns prefix caching off for %s: its Mamba2 layers' recurrent state "
            "is not kept at block boundaries (vLLM's mamba_cache_mode 'align'), so no "
            "cached prefix can be resumed.", arch.name)
        cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model_config.max_model_len
    hf_config = model_config.hf_text_config
    conv_dtype, ssm_dtype = mamba2_state_dtypes(model_config.dtype, cache)
    state = StateShapes(dims.heads, dims.head_dim, dims.state_size, dims.conv_dim,
                        dims.conv_kernel, ssm_dtype, conv_dtype).nbytes
    head_dim = (getattr(hf_config, "head_dim", None)
                or hf_config.hidden_size // hf_config.num_attention_heads)
    per_token = 2 * hf_config.num_key_value_heads * head_dim * model_config.dtype.itemsize
    step = cache.block_size
    block_size = step * -(-state // (step * per_token))
    if block_size != cache.block_size:
        logger.info_once("vllm-accel sets the KV cache block size to %d tokens for %s: an "
                         "attention block's page then holds a Mamba2 state (%d bytes).",
                         block_size, arch.name, state)
        cache.block_size = block_size
    page = block_size * per_token
    cache.mamba_page_size_padded = page if page > state else None


def check_runner(model_config, arch, parallel) -> None:
    """Generation for decoders; pooling (``--runner pooling``) for encoders,
    and for text decoders as embedders (``--convert embed``, vLLM's default
    for them), on one device."""
    runner, name = model_config.runner_type, arch.name
    if runner not in ("generate", "pooling"):
        raise ValueError(f"vllm-accel does not serve runner '{runner}'. Allowed: 'generate' "
                         f"and 'pooling' (--runner).")
    if arch.encoder is not None and runner != "pooling":
        raise ValueError(f"{name} is encoder-only: serve it with --runner pooling (it embeds, "
                         f"classifies or scores; it cannot generate).")
    if runner != "pooling":
        return
    if arch.encoder is None:
        if model_config.convert_type not in ("embed", "none"):
            raise ValueError(
                f"vllm-accel pools {name} as an embedder only (--convert embed), not "
                f"--convert {model_config.convert_type}.")
        if arch.vision_adapter is not None or arch.recurrent_state is not None:
            raise ValueError(f"vllm-accel does not pool {name} (pooling runs text decoders "
                             f"of attention layers and encoders): use --runner generate.")
    if parallel.tensor_parallel_size > 1:
        raise ValueError("vllm-accel runs pooling models on one device: tensor_parallel_size "
                         "must be 1 with --runner pooling.")
    if arch.encoder is not None:
        check_encoder_positions(model_config, arch)


def check_encoder_positions(model_config, arch) -> None:
    """An encoder's prompt may hold no more tokens than its position table has
    rows (RoBERTa's and MPNet's first ``padding_idx + 1`` rows are never a
    token's)."""
    hf_config = model_config.hf_config
    rows = hf_config.max_position_embeddings
    if arch.encoder == "roberta":
        rows -= hf_config.pad_token_id + 1
    elif arch.encoder == "mpnet":  # HF's MPNet: padding_idx 1, whatever the config says
        rows -= 2
    if model_config.max_model_len > rows:
        raise ValueError(
            f"max_model_len={model_config.max_model_len} is longer than {arch.name}'s position "
            f"table allows: at most {rows} tokens (set --max-model-len {rows}).")


def use_v1_runner_protocol(vllm_config) -> None:
    """Our runner speaks vLLM's V1 model runner protocol. vLLM's scheduler
    switches to the V2 one (resumed requests sent as new ones, no copy of a
    request's tokens) wherever Triton imports, i.e. with any CUDA build of
    torch, unless VLLM_USE_V2_MODEL_RUNNER says otherwise."""
    from vllm import envs

    name = "VLLM_USE_V2_MODEL_RUNNER"
    if name in os.environ and envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ValueError(f"{name}={os.environ[name]}: vllm-accel's model runner is a V1 "
                         f"model runner; unset {name} or set it to 0.")
    use_v1_model_runner()  # why: patches.py, 15
    if vllm_config.use_v2_model_runner:  # a feature that only V2 has, or a stale env cache
        raise ValueError("vLLM chose its V2 model runner for this configuration; "
                         "vllm-accel's runner is a V1 model runner.")


def check_parallelism(parallel) -> None:
    """Tensor parallelism is supported; other ways to split a model are not."""
    unsupported = {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
        "decode_context_parallel_size": parallel.decode_context_parallel_size,
    }
    for name, size in unsupported.items():
        if size > 1:
            raise ValueError(
                f"vllm-accel does not support {name}={size} (--{name.replace('_', '-')}): "
                "it must be 1. To split a model across workers use "
                "--tensor-parallel-size."
            )


def check_head_split(model_config, tp_size: int) -> None:
    """FMS splits attention heads evenly over the ranks and KV heads evenly,
    or replicates them when there are fewer KV heads than ranks (each rank
    then needs exactly one): fail now, naming the sizes that work, rather
    than in an assertion inside every worker. (vLLM itself already refuses a
    size that does not divide the attention heads.)"""
    heads = model_config.model_arch_config.total_num_attention_heads
    kv_heads = model_config.get_total_num_kv_heads()

    def splits(size: int) -> bool:
        kv_ok = kv_heads % size == 0 if kv_heads >= size else size % kv_heads == 0
        return heads % size == 0 and kv_ok

    if not splits(tp_size):
        working = [size for size in range(1, heads + 1) if splits(size)]
        raise ValueError(
            f"tensor_parallel_size={tp_size} (--tensor-parallel-size) cannot split "
            f"{model_config.architectures[0]}'s {heads} attention heads and {kv_heads} "
            f"KV heads evenly: use one of {working}."
        )


def disable_modalities(model_config, modalities: tuple[str, ...]) -> None:
    """Limit these inputs to 0 per prompt: vLLM then answers a request with one
    with a 400, and does not size its multimodal budget with a dummy of it."""
    mm_config = model_config.multimodal_config
    for modality in modalities:
        user_limit = mm_config.limit_per_prompt.get(modality)  # None: not set
        if user_limit is not None and mm_config.get_limit_per_prompt(modality) != 0:
            raise ValueError(
                f"vllm-accel does not support {modality} inputs for "
                f"{model_config.architectures[0]}: set --limit-mm-per-prompt "
                f"'{{\"{modality}\": 0}}' or leave it out (images are supported)."
            )
        limit_modality_to_zero(mm_config, modality)


def check_image_tokens(inputs: dict, served_image_token_id: int | None, error) -> None:
    """Every image token must belong to an image's placeholder: vLLM passes
    a literal image token typed in the text on to the model otherwise. An
    image fills its placeholder's embedding positions with the image token
    (all of them, or, e.g. for Molmo, those marked ``is_embed``; the rest
    hold other tokens), so a prompt with images names its own image token."""
    images = (inputs.get("mm_placeholders") or {}).get("image", [])
    prompt = list(inputs.get("prompt_token_ids") or [])
    token = served_image_token_id
    if images:
        place = images[0]
        first = 0 if place.is_embed is None else int(place.is_embed.nonzero()[0, 0])
        token = prompt[place.offset + first]
    if token is None:
        return
    expected = sum(int(place.get_num_embeds()) for place in images)
    found = prompt.count(token)
    if found != expected:
        raise error(
            f"The prompt has {found} image tokens but its {len(images)} image(s) "
            f"fill {expected}: the image token (id {token}) must not "
            "appear in the prompt text; send each image as an image part.",
            parameter="image",
        )
