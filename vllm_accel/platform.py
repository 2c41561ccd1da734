"""The ``accel`` platform: what vLLM asks of a hardware backend.

vLLM picks this class through the ``vllm.platform_plugins`` entry point. It
names our worker and fixes the configuration our runner needs (block size, no
vLLM-side compilation, vLLM's V1 runner protocol, async scheduling only where
it overlaps) without overriding what a user set explicitly unless it must, and
rejects what we do not support with messages that say what is allowed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_accel.architectures import (check_layer_kinds, find_architecture,
                                      tensor_parallel_names)
from vllm_accel import devices
from vllm_accel.config_checks import (check_head_split, check_image_tokens, check_parallelism,
                                      check_runner, configure_recurrent_state,
                                      disable_modalities, use_v1_runner_protocol)
from vllm_accel.devices import DeviceBackend, select_backend
from vllm_accel.log import get_logger
from vllm_accel.patches import use_spawn_for_workers
from vllm_accel.settings import (AccelSettings, env_var_name, known_env_vars, load_settings,
                                 resolve_device)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

DEFAULT_BLOCK_SIZE = 32
WORKER_CLS = "vllm_accel.worker.worker.AccelWorker"


class _FollowsBackend:
    """A platform attribute that names the device backend the settings select
    (read on the class or on vLLM's ``current_platform`` alike): the
    simulated accelerator computes on the host CPU, so its tensors live on
    "cpu"; the cuda backend's on "cuda"."""

    def __init__(self, values: dict[str, str]):
        self.values = values

    def __get__(self, instance, owner) -> str:
        return self.values[owner._device()]


class AccelPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name = _FollowsBackend({"cpu": "cpu", "hpu": "hpu", "cuda": "cuda"})
    device_type = _FollowsBackend({"cpu": "cpu", "hpu": "hpu", "cuda": "cuda"})
    dispatch_key = _FollowsBackend({"cpu": "CPU", "hpu": "HPU", "cuda": "CUDA"})
    dist_backend = _FollowsBackend(devices.DIST_BACKENDS)
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # ---- device queries ---------------------------------------------------
    # vLLM calls these as class methods, in any process, often before a model
    # is configured: they answer for the device backend the settings select.

    # The device backend of the engine whose worker runs in this process (set
    # by the worker; None: no worker here). vLLM sets its current config only
    # around a worker's init, not around its steps or on other threads, where
    # the settings alone give the environment's device, not one chosen in
    # ``additional_config``. Process-wide state: patches.py lists it (21).
    worker_device: str | None = None

    @classmethod
    def _device(cls) -> str:
        import sys

        config = None
        module = sys.modules.get("vllm.config.vllm")  # vLLM reads dispatch_key importing it
        if hasattr(module, "get_current_vllm_config_or_none"):
            config = module.get_current_vllm_config_or_none()
        if config is None and cls.worker_device is not None:
            return cls.worker_device
        return resolve_device(load_settings(config.additional_config if config else None))

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        device = cls._device()
        if device == "cuda":
            return f"vllm-accel (cuda: {devices.device_name(device, device_id)})"
        return f"vllm-accel ({device})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return devices.total_memory(cls._device(), device_id)

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        return devices.memory_in_use(cls._device())

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return devices.compute_units(cls._device(), device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return devices.device_uuid(cls._device(), device_id)

    @classmethod
    def get_all_gpu_pci_bus_ids(cls) -> dict[int, str]:
        return devices.pci_bus_ids(cls._device())

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        devices.check_dtype(cls._device(), dtype)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA device too

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        """Our runner keeps one KV cache per decoder layer of a decoder-only
        model; encoder-decoder models (two attention layers per index) are
        refused at start-up, so nothing here can share an index."""

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError(
            "vllm-accel does not support LoRA adapters (--enable-lora): its FMS "
            "models have no LoRA layers.")

    @classmethod
    def stateless_init_device_torch_dist_pg(cls, backend, prefix_store, group_rank,
                                            group_size, timeout):
        """A process group outside torch.distributed's global state (vLLM uses
        them for data parallelism and elastic expert parallelism)."""
        from vllm_accel.compat import stateless_process_group

        return stateless_process_group(devices.DIST_BACKENDS[cls._device()],
                                       prefix_store, group_rank, group_size, timeout)

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        """vLLM's hybrid KV cache manager: a KV cache group per layer kind
        (attention, recurrent state)."""
        return True

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

        settings = load_settings(vllm_config.additional_config)
        backend = select_backend(settings)
        logger.info_once(
            "vllm-accel platform active: device backend '%s', compile backend '%s'",
            backend.device, backend.compile_backend,
        )

        parallel = vllm_config.parallel_config
        check_parallelism(parallel)
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        if parallel.distributed_executor_backend is None:
            # vLLM picks "mp" itself for more than one worker (or "ray" inside a
            # Ray placement group); one worker runs in the engine's process.
            parallel.distributed_executor_backend = "uni" if parallel.world_size == 1 else "mp"
        if parallel.world_size > 1 and use_spawn_for_workers():  # why: patches.py, 4
            logger.info_once(
                "vllm-accel starts its %d tensor-parallel workers with 'spawn' "
                "(set VLLM_WORKER_MULTIPROC_METHOD to choose).", parallel.world_size,
            )

        if vllm_config.speculative_config is not None:
            raise ValueError("vllm-accel does not support speculative decoding yet.")
        use_v1_runner_protocol(vllm_config)

        scheduler = vllm_config.scheduler_config
        pooling = vllm_config.model_config is not None and \
            vllm_config.model_config.runner_type == "pooling"
        if scheduler.async_scheduling and pooling:
            # A pooling step's outputs come from its forward (no sampling to overlap).
            logger.info_once("vllm-accel runs pooling models with async scheduling off.")
            scheduler.async_scheduling = False
        elif scheduler.async_scheduling and not keeps_async_scheduling(settings, backend):
            # vLLM turns it on by default; it pays only where the device runs
            # apart from the host.
            logger.info_once("vllm-accel runs with async scheduling off on device '%s' (%s=%s).",
                             backend.device, env_var_name("async_scheduling"),
                             settings.async_scheduling)
            scheduler.async_scheduling = False
        elif scheduler.async_scheduling:
            logger.info_once("vllm-accel runs with async scheduling on.")

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
            arch = cls._check_model(model_config, parallel)
            dims = arch.recurrent_dims(model_config.hf_text_config)
            if dims is not None:
                configure_recurrent_state(vllm_config, arch, dims, backend)
            elif arch.recurrent_state is not None:
                # No recurrent layer in this checkpoint (an all-attention
                # Granite 4): none of vLLM's Mamba state handling either.
                vllm_config.cache_config.mamba_cache_mode = "none"

    @classmethod
    def _check_model(cls, model_config, parallel):
        arch = find_architecture(model_config.architectures)
        check_runner(model_config, arch, parallel)
        check_layer_kinds(arch, model_config.hf_text_config)
        if (parallel.tensor_parallel_size > 1
                and arch.recurrent_dims(model_config.hf_text_config) is not None):
            raise ValueError(
                f"vllm-accel cannot shard {arch.name} across workers: FMS's tensor-parallel "
                f"strategy does not shard its Mamba2 layers (recurrent state). "
                f"tensor_parallel_size must be 1 for it.")
        if parallel.tensor_parallel_size > 1 and not arch.tensor_parallel:
            raise ValueError(
                f"vllm-accel cannot shard {arch.name} across workers yet: "
                f"tensor_parallel_size must be 1 for it "
                f"(tensor parallelism supports {', '.join(tensor_parallel_names())})."
            )
        if parallel.tensor_parallel_size > 1:
            check_head_split(model_config, parallel.tensor_parallel_size)
        from vllm_accel.multimodal.mm_mappings import vision_adapter_class

        adapter_class = vision_adapter_class(model_config.hf_config)
        # Set anew for every model (a text model after a vision model in one
        # process must not inherit its image token).
        cls.served_image_token_id = (
            adapter_class.image_token_id(model_config) if adapter_class else None)
        if adapter_class is not None and model_config.multimodal_config is not None:
            disable_modalities(model_config, adapter_class.unsupported_modalities)
            # vLLM 0.33 may leave pixel normalisation to its own model
            # classes (raw pixels from the processor); our ports take
            # pixels as HF's processors normalise them.
            model_config.multimodal_config.mm_device_do_normalize = False
        return arch

    # The image token of the vision model this process serves (None: a text
    # model), for prompts without images. vLLM's validate_request is given no
    # model, so in a process that configures several models (a notebook, the
    # tests) this is the one configured last; a prompt with images is checked
    # against its own placeholders' token instead, whatever model it is for.
    # Process-wide state: patches.py lists it (16).
    served_image_token_id: int | None = None

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
        if isinstance(processed_inputs, dict):
            check_image_tokens(processed_inputs, cls.served_image_token_id, VLLMValidationError)

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


def keeps_async_scheduling(settings: AccelSettings, backend: DeviceBackend) -> bool:
    """Whether vLLM's async scheduling (on by default) stays on: by default only
    where the device runs apart from the host, so that scheduling overlaps."""
    return {"on": True, "off": False}.get(settings.async_scheduling,
                                          backend.runs_apart_from_host)
