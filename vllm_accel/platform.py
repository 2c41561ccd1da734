"""The ``accel`` platform: what vLLM asks of a hardware backend.

vLLM picks this class through the ``vllm.platform_plugins`` entry point. It
names our worker and fixes the configuration our runner needs (block size, no
vLLM-side compilation or async scheduling) without overriding
what a user set explicitly unless it must, and rejects what we do not support
with messages that say what is allowed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_accel.devices import select_backend
from vllm_accel.settings import known_env_vars, load_settings, resolve_device

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# A child of the "vllm" logger: same handler, format and VLLM_LOGGING_LEVEL.
logger = init_logger(f"vllm.{__name__}")

DEFAULT_BLOCK_SIZE = 32
WORKER_CLS = "vllm_accel.worker.worker.AccelWorker"


class AccelPlatform(Platform):
    _enum = PlatformEnum.OOT
    # The simulated accelerator computes on the host CPU, so tensors live on
    # "cpu"; vLLM builds torch devices from both names.
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # ---- device queries -----------------------------------------------------

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        settings = load_settings(config.additional_config if config is not None else None)
        return f"vllm-accel ({resolve_device(settings)})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return psutil.virtual_memory().total

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        pass

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        pass  # no vLLM C++ ops: the runner brings its own attention

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # Our runner never builds vLLM attention layers; vLLM still wants a real,
        # importable class here, and this one is pure PyTorch.
        return "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"

    # ---- configuration ------------------------------------------------------

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        backend = select_backend(load_settings(vllm_config.additional_config))
        logger.info_once(
            "vllm-accel platform active: device backend '%s', compile backend '%s'",
            backend.device, backend.compile_backend,
        )

        parallel = vllm_config.parallel_config
        _check_parallelism(parallel)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if parallel.distributed_executor_backend is None:
            # vLLM picks "mp" itself for more than one worker (or "ray" inside a
            # Ray placement group); one worker runs in the engine's process.
            parallel.distributed_executor_backend = "uni" if parallel.world_size == 1 else "mp"
        if parallel.world_size > 1 and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
            # Our workers compute with OpenMP threads, and a process forked after
            # its parent ran an OpenMP parallel region hangs in its first one
            # (libgomp is not fork-safe; e.g. LLM(...) after any torch math).
            # Spawned workers start clean. vLLM does the same for CUDA.
            logger.info_once(
                "vllm-accel starts its %d tensor-parallel workers with 'spawn' "
                "(set VLLM_WORKER_MULTIPROC_METHOD to choose).", parallel.world_size,
            )
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        if vllm_config.speculative_config is not None:
            raise ValueError("vllm-accel does not support speculative decoding yet.")

        scheduler = vllm_config.scheduler_config
        if scheduler.async_scheduling:
            # vLLM turns it on by default; our runner samples synchronously.
            logger.info_once("vllm-accel runs with async scheduling off.")
            scheduler.async_scheduling = False

        cache = vllm_config.cache_config
        if cache.block_size is None or not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE

        compilation = vllm_config.compilation_config
        if compilation.mode != CompilationMode.NONE:
            logger.info_once(
                "vllm-accel replaces vLLM compilation mode %s with its own "
                "(the runner compiles the model itself).",
                compilation.mode.name,
            )
            compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []

        model_config = vllm_config.model_config
        if model_config is not None:
            from vllm_accel.model.fms_causal_lm import TP_ARCHITECTURES, check_architecture

            if model_config.runner_type != "generate":
                raise ValueError(
                    f"vllm-accel serves text generation only, not runner "
                    f"'{model_config.runner_type}'."
                )
            arch = check_architecture(model_config.architectures)
            if parallel.tensor_parallel_size > 1 and arch not in TP_ARCHITECTURES:
                raise ValueError(
                    f"vllm-accel cannot shard {arch} across workers yet: "
                    f"tensor_parallel_size must be 1 for it "
                    f"(tensor parallelism supports {', '.join(TP_ARCHITECTURES)})."
                )
            from vllm_accel.multimodal.mm_mappings import get_mm_utils_cls

            # Set anew for every model (a text model after a vision model in
            # one process must not inherit its image token).
            mm_utils_cls = get_mm_utils_cls(model_config.hf_config)
            cls.image_token_id = (
                mm_utils_cls.image_token_id(model_config.hf_config) if mm_utils_cls else None
            )
            if mm_utils_cls is not None and model_config.multimodal_config is not None:
                _disable_modalities(model_config, mm_utils_cls.unsupported_modalities)
                # vLLM 0.33 may leave pixel normalisation to its own model
                # classes (raw pixels from the processor); our ports take
                # pixels as HF's processors normalise them.
                model_config.multimodal_config.mm_device_do_normalize = False

    # The image token of the model last configured in this process (the front
    # end's validate_request gets no model config); None for text models.
    image_token_id: int | None = None

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # VLLMValidationError, unlike a plain ValueError, reaches an API client
        # as an HTTP 400 with this message.
        from vllm.exceptions import VLLMValidationError

        if getattr(params, "prompt_logprob_token_ids", None) is not None:
            raise VLLMValidationError(
                "vllm-accel does not support prompt_logprob_token_ids yet; use "
                "prompt_logprobs (the top-k per prompt position) instead.",
                parameter="prompt_logprob_token_ids",
            )
        if cls.image_token_id is not None and isinstance(processed_inputs, dict):
            cls._check_image_tokens(processed_inputs, VLLMValidationError)

    @classmethod
    def _check_image_tokens(cls, inputs: dict, error) -> None:
        """Every image token must belong to an image's placeholder: vLLM passes
        a literal image token typed in the text on to the model otherwise. An
        image fills its placeholder's embedding positions with the image token
        (all of them, or, e.g. for Molmo, those marked ``is_embed``; the rest
        hold other tokens)."""
        images = (inputs.get("mm_placeholders") or {}).get("image", [])
        expected = sum(int(place.get_num_embeds()) for place in images)
        found = list(inputs.get("prompt_token_ids") or []).count(cls.image_token_id)
        if found != expected:
            raise error(
                f"The prompt has {found} image tokens but its {len(images)} image(s) "
                f"fill {expected}: the image token (id {cls.image_token_id}) must not "
                "appear in the prompt text; send each image as an image part.",
                parameter="image",
            )

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check of VLLM_* variables, knowing ours too."""
        from vllm import envs

        from vllm.utils.torch_utils import OMP_NUM_THREADS_SET_BY_VLLM

        # vLLM's multiprocessing executor sets a marker variable of its own.
        known = set(envs.environment_variables) | known_env_vars() | {OMP_NUM_THREADS_SET_BY_VLLM}
        for name in os.environ:
            if name.startswith("VLLM_") and name not in known:
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable detected: {name}")
                logger.warning("Unknown vLLM environment variable detected: %s", name)


def _check_parallelism(parallel) -> None:
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


def _disable_modalities(model_config, modalities: tuple[str, ...]) -> None:
    """Limit these inputs to 0 per prompt: vLLM then answers a request with one
    with a 400, and does not size its multimodal budget with a dummy of it."""
    mm_config = model_config.multimodal_config
    for modality in modalities:
        if mm_config.get_limit_per_prompt(modality) not in (0, 999):  # 999: not set
            raise ValueError(
                f"vllm-accel does not support {modality} inputs for "
                f"{model_config.architectures[0]}: set --limit-mm-per-prompt "
                f"'{{\"{modality}\": 0}}' or leave it out (images are supported)."
            )
        # vLLM's own parsing of {"video": 0} gives the options object it keeps.
        mm_config.limit_per_prompt.update(type(mm_config)._validate_limit_per_prompt({modality: 0}))
