"""Patches 1-3, 9-11, 17 and 20: those ``apply_patches`` applies in every vLLM
process (our ``vllm.general_plugins`` entry point), most of them through an
import hook once the module they concern is imported. ``patches.py`` lists
every patch and says why; it re-exports ``apply_patches``."""

from __future__ import annotations

import sys
import threading

# Relative imports: benchmarks/native_shims.py loads this package's modules
# under a package name of its own, where vllm_accel is not.
from .import_hooks import Alias, ShimFinder
from .log import get_logger  # imports vLLM only when called

# torchvision image-processor module -> its PIL variant (patch 1).
TORCHVISION_TO_PIL_MODULES = {
    "transformers.models.pixtral.image_processing_pixtral":
        "transformers.models.pixtral.image_processing_pil_pixtral",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl":
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
}
VIDEO_AUTO_MODULE = "transformers.models.auto.video_processing_auto"
TOPK_TOPP_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"  # patch 9
TOPK_TOPP_TRITON_MODULE = "vllm.v1.sample.ops.topk_topp_triton"  # patch 9
ARCH_CONVERTOR_MODULE = "vllm.transformers_utils.model_arch_config_convertor"  # patch 10
CUSTOM_OPS_MODULE = "vllm._custom_ops"  # patch 11
MODEL_REGISTRY_MODULE = "vllm.model_executor.models.registry"  # patch 20
# The lazy modules that export PixtralProcessor (patch 17).
PIXTRAL_PROCESSOR_MODULES = ("transformers", "transformers.models.pixtral")

_lock = threading.Lock()
_finder: ShimFinder | None = None
_video_registered = False


def torchvision_available() -> bool:
    """transformers' own test (package present), so the shims switch on
    exactly when transformers falls back to its PIL image processors."""
    from transformers.utils import is_torchvision_available

    return is_torchvision_available()


def apply_patches() -> None:
    """Idempotent and cheap: apply every patch above once per process."""
    global _finder
    _make_accelerator_cache_calls_noops()
    with _lock:
        if _finder is None:
            _finder = ShimFinder(_import_route)
            sys.meta_path.insert(0, _finder)
    # The modules may already be loaded (e.g. shims installed late).
    for name, hook in _POST_IMPORT_HOOKS.items():
        if name in sys.modules:
            hook()


def _make_accelerator_cache_calls_noops() -> None:
    """Patch 3. Asked at each call, not here: on a CUDA build torch asks the
    CUDA driver, which a process that only imports the plugin (vLLM's front
    end) has no need of."""
    import torch

    for name in ("empty_cache", "empty_host_cache"):
        original = getattr(torch.accelerator, name, None)
        if original is not None and not hasattr(original, "frees_nothing_without_accelerator"):
            setattr(torch.accelerator, name, _free_only_with_accelerator(original))


def _free_only_with_accelerator(free):
    import torch

    def guarded(*args, **kwargs) -> None:
        if torch.backends.cuda.is_built() and not torch.cuda.is_initialized():
            return  # this process has put nothing on a GPU
        if torch.accelerator.is_available():
            free(*args, **kwargs)

    guarded.frees_nothing_without_accelerator = True
    return guarded


def _import_route(fullname: str):
    """What the import hook does for a module name: None (nothing: most
    names), an alias (patch 1) or a patch to apply once the module is
    imported (2, 9-11, 17, 20)."""
    if fullname in TORCHVISION_TO_PIL_MODULES:
        return None if torchvision_available() else Alias(TORCHVISION_TO_PIL_MODULES[fullname])
    if fullname == VIDEO_AUTO_MODULE and torchvision_available():
        return None
    return _POST_IMPORT_HOOKS.get(fullname)


def _host_top_k_top_p() -> None:
    """Patch 9 (idempotent)."""
    module = sys.modules[TOPK_TOPP_MODULE]
    triton_path = module.apply_top_k_top_p
    if getattr(triton_path, "_vllm_accel_host_path", False) or not module.HAS_TRITON:
        return

    def apply_top_k_top_p(logits, k, p, *args, **kwargs):
        if logits.device.type == "cpu":
            return module.apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        return triton_path(logits, k, p, *args, **kwargs)

    apply_top_k_top_p._vllm_accel_host_path = True
    module.apply_top_k_top_p = apply_top_k_top_p


class _SplitPipelineView:
    """``current_platform`` as vLLM's Triton top-k/top-p module sees it
    (patch 9): cuda-alike wherever torch has a CUDA device, as the module's
    split top-p pipeline runs for every cuda tensor; the rest is the
    platform's own."""

    def __init__(self, platform):
        self._platform = platform

    def is_cuda_alike(self) -> bool:
        import torch

        return self._platform.is_cuda_alike() or torch.cuda.is_available()

    def __getattr__(self, name):
        return getattr(self._platform, name)


def _split_pipeline_seen() -> None:
    """Patch 9, its second part (idempotent)."""
    module = sys.modules[TOPK_TOPP_TRITON_MODULE]
    if not isinstance(module.current_platform, _SplitPipelineView):
        module.current_platform = _SplitPipelineView(module.current_platform)


def _torch_repetition_penalties() -> None:
    """Patch 11 (idempotent)."""
    import torch

    module = sys.modules[CUSTOM_OPS_MODULE]
    if hasattr(torch.ops._C, "apply_repetition_penalties_"):
        return  # a vLLM with its compiled ops
    module.apply_repetition_penalties_cuda = module.apply_repetition_penalties_torch


def _molmo_kv_heads_fallback() -> None:
    """Patch 10 (idempotent)."""
    module = sys.modules[ARCH_CONVERTOR_MODULE]
    if "molmo" in module.MODEL_ARCH_CONFIG_CONVERTORS:
        return

    class MolmoModelArchConfigConvertor(module.ModelArchConfigConvertorBase):
        def get_total_num_kv_heads(self) -> int:
            config = self.hf_text_config  # MolmoE's (OLMo keys) has no num_key_value_heads
            return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    module.MODEL_ARCH_CONFIG_CONVERTORS["molmo"] = MolmoModelArchConfigConvertor


def _real_pixtral_processor() -> None:
    """Patch 17 (idempotent)."""
    if torchvision_available():
        return
    name = "PixtralProcessor"
    for module_name in PIXTRAL_PROCESSOR_MODULES:
        module = sys.modules.get(module_name)
        missing = getattr(module, "_object_missing_backend", None)
        if not missing or missing.get(name) != ["torchvision"]:
            continue  # not loaded, done already, or torch is missing too
        del missing[name]
        # A placeholder class (metaclass DummyObject) the module cached.
        if getattr(type(vars(module).get(name)), "is_dummy", False):
            delattr(module, name)


def _inspect_models_in_process() -> None:
    """Patch 20 (idempotent)."""
    module = sys.modules[MODEL_REGISTRY_MODULE]
    in_subprocess = module._run_in_subprocess
    if getattr(in_subprocess, "_vllm_accel_in_process", False):
        return

    def run_inspection(fn):
        from vllm.platforms import current_platform

        if type(current_platform).__module__ != "vllm_accel.platform":
            return in_subprocess(fn)  # another platform: vLLM's way
        import torch

        cuda_before = torch.cuda.is_initialized()
        result = fn()
        if not cuda_before and torch.cuda.is_initialized():
            get_logger(__name__).warning(
                "vllm-accel: inspecting the model's vLLM class initialized CUDA in this "
                "process, so vLLM will spawn its engine core rather than fork it")
        return result

    run_inspection._vllm_accel_in_process = True
    module._run_in_subprocess = run_inspection


def _register_video_stubs() -> None:
    """Patch 2 (once)."""
    global _video_registered
    with _lock:
        if _video_registered:
            return
        _video_registered = True
    try:
        if not torchvision_available():
            from .video_stub import register  # imports transformers' processing

            register()
    except Exception:  # never break the import that triggered us
        get_logger(__name__).warning(
            "vllm-accel: could not register the stand-in video processor", exc_info=True)


# Module -> the patch applied once it is imported (also by apply_patches, in this order).
_POST_IMPORT_HOOKS = {
    VIDEO_AUTO_MODULE: _register_video_stubs, TOPK_TOPP_MODULE: _host_top_k_top_p,
    TOPK_TOPP_TRITON_MODULE: _split_pipeline_seen,
    ARCH_CONVERTOR_MODULE: _molmo_kv_heads_fallback, CUSTOM_OPS_MODULE: _torch_repetition_penalties,
    MODEL_REGISTRY_MODULE: _inspect_models_in_process,
    **dict.fromkeys(PIXTRAL_PROCESSOR_MODULES, _real_pixtral_processor),
}
