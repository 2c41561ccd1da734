"""Every architecture vllm-accel serves, described once.

One entry per architecture: the HF names vLLM reports for it, its HF
``model_type``, our FMS port when FMS lacks the model, its vision adapter
(``multimodal/mm_mappings``), whether FMS can shard it for tensor parallelism,
and whether its HF config is remote code. The platform, the model loader, the
vision-adapter lookup and the test fixtures all read this table.

Adding an architecture: one module (an FMS port under ``model/`` exposing
``FMS_PORT``, and/or a vision adapter under ``multimodal/mm_mappings/``) plus
one entry below. Nothing is imported here: ports and adapters are named by
dotted path and load only when their model is served (a leaf module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Architecture:
    hf_names: tuple[str, ...]  # HF config.architectures values
    model_type: str  # HF config.model_type (also the tiny test fixture's name)
    # "module:FMS_PORT" of our FMS-style port (model/ports.FmsPort): a model
    # FMS lacks, or FMS's own class where FMS cannot load the HF checkpoint
    # (Mixtral); None when FMS loads the model itself.
    fms_port: str | None = None
    # "module:Class" of the vision adapter (mm_mappings); None for text models.
    vision_adapter: str | None = None
    # FMS's TensorParallelStrategy can shard it (the decoder's heads and MLP
    # split; embeddings, LM head and the vision side whole on every rank).
    tensor_parallel: bool = False
    # Its HF config is remote code: the user must pass --trust-remote-code.
    remote_code: bool = False
    # FMS config fields set at load where FMS's defaults compute other than
    # HF's class: (field, value) pairs; a callable value is computed from the
    # checkpoint's HF config (fms_config_overrides).
    fms_overrides: tuple[tuple[str, object], ...] = ()
    # Layers that keep recurrent state (Mamba2): the state's dimensions, from
    # the checkpoint's HF config (None, or a config without such layers:
    # every layer attends).
    recurrent_state: Callable[[Any], Mamba2Dims | None] | None = None
    # "module:function" swapping layers of a loaded FMS model for ones the
    # runner drives its way: stateful layers over vLLM's paged state (Bamba),
    # attention blocks that keep our attention op and pass their layer's
    # attention layout (Granite SWA); None: none to swap.
    paged_layers: str | None = None
    # Each layer's attention window comes from the config's layer_types
    # ("sliding_attention": sliding_window; others full attention), and its
    # blocks (paged_layers) pass each layer's attention layout (its KV cache
    # group and window) to the attention op: windowed and full-attention
    # layers may mix. Else one window (sliding_window, or none) for every
    # layer, and a mix is refused.
    windows_by_layer_types: bool = False
    # An encoder-only model (bidirectional attention, no KV cache), served by
    # the pooling runner: FMS's model family that loads it ("bert",
    # "roberta" or "mpnet": model/fms_encoder.py); None: a decoder.
    encoder: str | None = None

    @property
    def name(self) -> str:
        return self.hf_names[0]

    def recurrent_dims(self, hf_config) -> Mamba2Dims | None:
        """The state of this checkpoint's recurrent layers; None: it has none."""
        return None if self.recurrent_state is None else self.recurrent_state(hf_config)

    def fms_config_overrides(self, hf_config) -> dict[str, object]:
        """``fms_overrides`` for this checkpoint: keyword arguments of FMS's ``get_model``."""
        return {field: value(hf_config) if callable(value) else value
                for field, value in self.fms_overrides}


def _rope_theta(hf_config) -> float:
    """The checkpoint's rotary base, from transformers 5's ``rope_parameters``
    (or an older config's ``rope_theta``); refuses a scaled rotary (YaRN, ...),
    which FMS's param builder drops as well."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"vllm-accel does not run {hf_config.architectures[0]} with rope "
                         f"type {rope_type!r} (only the default rotary embedding)")
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10_000.0)))


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 layer's state: an SSM state of ``heads x head_dim x
    state_size`` and the last ``conv_kernel - 1`` inputs of its convolution
    over ``intermediate + 2 * groups * state_size`` channels."""

    heads: int
    head_dim: int
    groups: int
    state_size: int
    conv_kernel: int
    intermediate: int

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.groups * self.state_size


def _mamba2_dims(hf_config) -> Mamba2Dims | None:
    """Bamba's and Granite 4's config fields (those vLLM's own models read);
    None where no layer is a Mamba2 one (transformers names them
    "linear_attention" in ``layer_types``, older configs "mamba")."""
    if not {"linear_attention", "mamba"} & set(hf_config.layer_types or ()):
        return None
    return Mamba2Dims(
        heads=hf_config.mamba_n_heads, head_dim=hf_config.mamba_d_head,
        groups=hf_config.mamba_n_groups, state_size=hf_config.mamba_d_state,
        conv_kernel=hf_config.mamba_d_conv,
        intermediate=int(hf_config.mamba_expand * hf_config.hidden_size))


def _attention_layers(hf_config) -> list[int]:
    return list(hf_config.attn_layer_indices or [])


def _max_positions(hf_config) -> int:
    return hf_config.max_position_embeddings


_ADAPTERS = "vllm_accel.multimodal.mm_mappings"

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(("LlamaForCausalLM",), "llama", tensor_parallel=True),
    Architecture(("GraniteForCausalLM",), "granite", tensor_parallel=True),
    Architecture(("MistralForCausalLM",), "mistral", tensor_parallel=True),
    # FMS zeroes the position embedding of every token equal to pad_id (0 by
    # default: StarCoder's <|endoftext|>); HF's class pads by attention mask.
    Architecture(("GPTBigCodeForCausalLM",), "gpt_bigcode", tensor_parallel=True,
                 fms_overrides=(("pad_id", None),)),
    # FMS's Qwen3 param builder (fms/models/hf/config_utils/param_builders.py,
    # build_qwen3_embeddings_params) passes the rotary base as "rope_base",
    # a field Qwen3Config lacks: FMS drops it and keeps its default rope_theta
    # (1e6). It also keeps multiple_of at 256, which rounds an
    # intermediate_size that is not a multiple of 256 up (its Llama builder
    # sets 1).
    Architecture(("Qwen3ForCausalLM",), "qwen3", tensor_parallel=True,
                 fms_overrides=(("rope_theta", _rope_theta), ("multiple_of", 1))),
    # FMS's own model class, through our port of its loading (model/mixtral.py);
    # its experts run as model/experts.py computes them.
    Architecture(("MixtralForCausalLM",), "mixtral", fms_port="vllm_accel.model.mixtral:FMS_PORT",
                 tensor_parallel=True),
    # Mamba2 layers, attention in attn_layer_indices. FMS's param builder
    # leaves out which layers attend (FMS's default: none), the rotary base
    # and the rotary table's length (FMS's default 262144 positions); its
    # multiple_of (256) would round an MLP width that is not a multiple of it.
    # FMS's tensor-parallel strategy does not shard its Mamba2 mixers.
    Architecture(("BambaForCausalLM",), "bamba",
                 fms_overrides=(("attn_layer_indices", _attention_layers),
                                ("rope_theta", _rope_theta), ("multiple_of", 1),
                                ("max_expected_seq_len", _max_positions)),
                 recurrent_state=_mamba2_dims,
                 paged_layers="vllm_accel.model.bamba:page_recurrent_layers"),
    # Granite 4: Mamba2 and attention layers (or attention only), with
    # experts beside a shared MLP or dense (num_local_experts 0). FMS maps it
    # to its Granite, which has neither Mamba2 layers nor experts: our port.
    Architecture(("GraniteMoeHybridForCausalLM",), "granitemoehybrid",
                 fms_port="vllm_accel.model.granite_moe_hybrid:FMS_PORT",
                 recurrent_state=_mamba2_dims),
    # Granite with sliding-window attention in the layers its layer_types
    # name and a learned attention sink per head in every layer. FMS's block
    # names its own attention op (it would replace ours): model/windowed_blocks.py
    # swaps the blocks for ones that keep ours and pass their layout.
    Architecture(("GraniteSWAForCausalLM",), "granite_swa", tensor_parallel=True,
                 paged_layers="vllm_accel.model.windowed_blocks:page_attention_layers",
                 windows_by_layer_types=True),
    # GPT-OSS: FMS's own model through our port of its loading
    # (model/gpt_oss.py): windowed layers as layer_types name them beside
    # full-attention ones, a sink per head, YaRN rotary, experts with biases
    # and a clamped SwiGLU (model/experts.py). Its blocks are swapped as
    # Granite SWA's. FMS's tensor-parallel experts load no biases.
    Architecture(("GptOssForCausalLM",), "gpt_oss", fms_port="vllm_accel.model.gpt_oss:FMS_PORT",
                 paged_layers="vllm_accel.model.windowed_blocks:page_attention_layers",
                 windows_by_layer_types=True),
    # Encoders for pooling: embedders (headless checkpoints) and classifiers
    # (cross-encoders: one label), FMS's RoBERTa class for both families.
    Architecture(("BertModel", "BertForSequenceClassification"), "bert", encoder="bert"),
    Architecture(("RobertaModel", "RobertaForSequenceClassification", "XLMRobertaModel",
                  "XLMRobertaForSequenceClassification"), "roberta", encoder="roberta"),
    # MPNet embedders (sentence-transformers' publish MPNetModel weights
    # under MPNetForMaskedLM, FMS's name): FMS's MPNet, with its relative
    # position bias. vLLM has no class for them (model/vllm_registry.py).
    Architecture(("MPNetModel", "MPNetForMaskedLM"), "mpnet", encoder="mpnet"),
    Architecture(
        ("LlavaNextForConditionalGeneration",), "llava_next",
        vision_adapter=f"{_ADAPTERS}.llava_next:LlavaNextVisionAdapter", tensor_parallel=True,
    ),
    Architecture(
        ("Qwen2_5_VLForConditionalGeneration",), "qwen2_5_vl",
        fms_port="vllm_accel.model.qwen2_5_vl:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.qwen2_5_vl:Qwen2_5_VLVisionAdapter", tensor_parallel=True,
    ),
    # Our Qwen2 decoder configured as Qwen3's (per-head q/k norms, interleaved
    # M-RoPE) with DeepStack features added after its first layers, and the
    # Qwen3-VL tower (model/qwen3_vl.py). Dense only.
    Architecture(
        ("Qwen3VLForConditionalGeneration",), "qwen3_vl",
        fms_port="vllm_accel.model.qwen3_vl:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.qwen3_vl:Qwen3VLVisionAdapter", tensor_parallel=True,
    ),
    # FMS's own mistral3 (Mistral text, Pixtral tower); the tower runs over
    # flat patch rows, images kept apart (model/pixtral_vision.py).
    Architecture(
        ("Mistral3ForConditionalGeneration",), "mistral3",
        vision_adapter=f"{_ADAPTERS}.mistral3:Mistral3VisionAdapter", tensor_parallel=True,
    ),
    Architecture(
        ("MolmoForCausalLM",), "molmo",
        fms_port="vllm_accel.model.molmo:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.molmo:MolmoVisionAdapter", tensor_parallel=True,
        remote_code=True,
    ),
    # MolmoE-1B: Molmo's vision side and processor, an OLMoE decoder (our
    # Qwen2 decoder with experts, model/molmoe.py). Its remote config says
    # model_type "molmo" as Molmo's does: "molmoe" names only our fixture.
    Architecture(
        ("OLMoForCausalLM",), "molmoe",
        fms_port="vllm_accel.model.molmoe:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.molmo:MolmoVisionAdapter", tensor_parallel=True,
        remote_code=True,
    ),
)


# Architectures FMS maps (its HF registry) that the runner cannot execute
# yet, with the layer kinds it lacks for them: what FMS's registry cannot say.
MISSING_LAYER_KINDS: dict[str, str] = {
    "RobertaForMaskedLM": "masked-LM heads (encoder-only models)",
    "BertForMaskedLM": "masked-LM heads (encoder-only models)",
    "RobertaForQuestionAnswering": "question answering (encoder-only models)",
}


def by_hf_names(hf_names: list[str] | None) -> Architecture | None:
    """The entry for a config's ``architectures``, or None."""
    return next((arch for name in hf_names or [] for arch in ARCHITECTURES
                 if name in arch.hf_names), None)


def find_architecture(hf_names: list[str] | None) -> Architecture:
    """The entry for a config's ``architectures``, or fail naming what is
    missing (a layer kind, for an architecture FMS maps) and what is supported."""
    arch = by_hf_names(hf_names)
    if arch is not None:
        return arch
    supported = sorted(name for arch in ARCHITECTURES for name in arch.hf_names)
    missing = next((MISSING_LAYER_KINDS[n] for n in hf_names or [] if n in MISSING_LAYER_KINDS),
                   None)
    reason = (f"FMS maps it, but the runner does not execute its layer kinds yet ({missing})"
              if missing else "FMS has no model for it")
    raise ValueError(
        f"vllm-accel cannot run model architecture {hf_names}: {reason}. Its FMS model "
        f"wrapper supports {', '.join(supported)}."
    )


def layer_windows(arch: Architecture, hf_config, num_layers: int) -> list[int]:
    """Each layer's attention window (0: full attention): from the config's
    ``layer_types`` where the architecture reads them
    (``windows_by_layer_types``), else the config's ``sliding_window`` for
    every layer (what vLLM's ``get_sliding_window`` reads)."""
    window = getattr(hf_config, "sliding_window", None) or 0
    kinds = getattr(hf_config, "layer_types", None)
    if arch.windows_by_layer_types and kinds:
        return [window if kind == "sliding_attention" else 0 for kind in kinds]
    return [window] * num_layers


def check_layer_kinds(arch: Architecture, hf_config) -> None:
    """Fail, naming the setting, for a config that asks for a layer kind the
    runner does not execute. Windowed and full-attention layers mix (a KV
    cache group per kind) only where the architecture attends each layer by
    its ``layer_types`` (``windows_by_layer_types``); elsewhere every layer
    has the same window. A rotary base per layer (``layer_rope_theta``,
    0 for no rotary) is refused unless it is one base for every layer: FMS's
    models have one rotary embedding."""
    name = arch.name
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if (getattr(hf_config, "sliding_window", None) and len(kinds & _ATTENTION_KINDS) > 1
            and not arch.windows_by_layer_types):
        raise ValueError(
            f"vllm-accel runs {name}'s sliding-window attention only where every layer has "
            f"the window: its config mixes {sorted(kinds)} in its layer_types. Allowed: one "
            f"attention kind for every layer (windowed and full-attention layers mix for "
            f"{', '.join(a.name for a in ARCHITECTURES if a.windows_by_layer_types)}).")
    thetas = set(getattr(hf_config, "layer_rope_theta", None) or ())
    rope = getattr(hf_config, "rope_parameters", None) or {}
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if thetas and thetas != {base}:
        raise ValueError(
            f"vllm-accel cannot run {name} with a rotary base per layer: its config's "
            f"layer_rope_theta holds {sorted(thetas)} (0: no rotary). Allowed: every layer "
            f"at the model's rope_theta ({base}).")


_ATTENTION_KINDS = {"full_attention", "sliding_attention"}


def by_model_type(model_type: str | None) -> Architecture | None:
    return next((arch for arch in ARCHITECTURES if arch.model_type == model_type), None)


def tensor_parallel_names() -> list[str]:
    return [arch.name for arch in ARCHITECTURES if arch.tensor_parallel]


def load_object(dotted_path: str):
    """``"package.module:name"`` -> that object (imported now)."""
    import importlib

    module, sep, name = dotted_path.partition(":")
    if not (module and sep and name):
        raise ValueError(f"expected 'package.module:name', got {dotted_path!r}")
    return getattr(importlib.import_module(module), name)
