"""Loading a model for the runner: the FMS model (a decoder, or an
encoder-only model for pooling), our CPU kernels and the layers packed for
them (mixture-of-experts layers too), the vision adapter and encoder,
compiled layers."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import ModelConfig

from vllm_accel import kernels
from vllm_accel.compat import compile_sampler_logprob_ranks
from vllm_accel.devices import DeviceBackend
from vllm_accel.kernels import CpuKernels
from vllm_accel.log import get_logger
from vllm_accel.model import experts, half_split_rope, saved_graphs
from vllm_accel.architectures import find_architecture
from vllm_accel.model.fms_causal_lm import FmsCausalLM, load_fms_model
from vllm_accel.model.fms_encoder import FmsEncoder, load_fms_encoder
from vllm_accel.model.packed_linear import pack_linear_layers
from vllm_accel.multimodal.encoder import VisionEncoder
from vllm_accel.multimodal.mm_mappings import vision_adapter_class
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.settings import AccelSettings
from vllm_accel.worker.compile_stats import CompileStats

logger = get_logger(__name__)


@dataclass
class LoadedModel:
    model: FmsCausalLM | FmsEncoder  # the text model the runner calls
    kernels: CpuKernels  # what every forward's context names (cpu only; else none)
    vision: VisionAdapter | None = None  # vision-language models only
    vision_encoder: VisionEncoder | None = None


def load_model(model_config: ModelConfig, backend: DeviceBackend, settings: AccelSettings,
               token_buckets: list[int], compile_stats: CompileStats,
               tp_group=None) -> LoadedModel:
    hf_config = model_config.hf_config
    on_cpu = backend.device == "cpu"
    use_kernels = on_cpu and settings.cpu_kernels
    kernel_dir = settings.cache_dir / "kernels"
    if use_kernels:
        kernels.start_building(kernel_dir)  # while the weights load
    encoder_family = find_architecture(hf_config.architectures).encoder
    if encoder_family is not None:
        fms_model = load_fms_encoder(model_config.model, hf_config, encoder_family,
                                     model_config.dtype, backend.device)
    else:
        fms_model = load_fms_model(model_config.model, hf_config, model_config.dtype,
                                   backend.device,
                                   trust_remote_code=model_config.trust_remote_code,
                                   tp_group=tp_group)
    rotated = half_split_rope.install(fms_model, model_config.max_model_len)
    logger.info("vllm_accel rotary embedding on head halves: %d attention layers", rotated)
    adapter_class = vision_adapter_class(hf_config)
    vision = adapter_class(model_config, fms_model) if adapter_class is not None else None
    text_model = fms_model if vision is None else vision.text_model
    cpu_kernels = kernels.load(kernel_dir) if use_kernels else kernels.NO_KERNELS
    experts.install(fms_model, cpu_kernels.linear)  # mixture-of-experts layers, if any
    if on_cpu:
        packed = pack_linear_layers(fms_model, cpu_kernels.linear, decoder=text_model)
        by_kernel = sum(getattr(m, "by_kernel", False) for m in fms_model.modules())
        logger.info("vllm_accel linear layers packed: %d (%s), %d by our kernel, the rest "
                    "by oneDNN", packed, model_config.dtype, by_kernel)
        if not settings.cpu_kernels:
            logger.info("vllm_accel cpu kernels off (cpu_kernels=false): oneDNN and torch only")
    loaded = LoadedModel(fms_model if encoder_family else FmsCausalLM(text_model),
                         cpu_kernels, vision)
    if tp_group is not None and not encoder_family and not loaded.model.head_replicated:
        # Only the driver computes logits: a sharded head would need every rank.
        raise ValueError(
            f"vllm-accel tensor parallelism needs the LM head replicated on every "
            f"rank; {type(loaded.model.fms_model).__name__}'s is sharded.")
    if not encoder_family:
        # vLLM's sampler ranks logprobs over the logits' columns (the head's
        # rows: more than vocab_size for some models): its graph for them
        # now, not counted as ours.
        compile_sampler_logprob_ranks(loaded.model.logits_width, backend.device)
        compile_stats.restart()
    compile_backend = backend.compile_backend if backend.compiles else None
    saved = None
    if compile_backend is not None:
        compile_stats.configure(settings.cache_dir)
        # Graphs saved whole (a warm start without dynamo): inductor on the
        # cpu, one rank (untried with the collectives of tensor parallelism
        # and on GPUs: the GPU host's torch 2.11 cannot save them), a torch
        # that can (else dynamo traces and inductor's cache gives the kernels).
        if (compile_backend == "inductor" and on_cpu and tp_group is None
                and saved_graphs.available()):
            saved = saved_graphs.SavedGraphs(compile_stats.saved_graphs_dir)
        loaded.model.compile_layers(compile_backend, token_buckets, saved,
                                    backend.shares_layer_graphs(encoder_family is not None))
    if vision is not None:
        loaded.vision_encoder = VisionEncoder(vision, compile_backend,
                                              settings.multimodal_buckets, saved,
                                              backend.shared_encoder_graphs)
    return loaded
