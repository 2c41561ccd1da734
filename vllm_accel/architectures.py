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

from dataclasses import dataclass


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
    # HF's class: (field, value) pairs.
    fms_overrides: tuple[tuple[str, object], ...] = ()

    @property
    def name(self) -> str:
        return self.hf_names[0]


_ADAPTERS = "vllm_accel.multimodal.mm_mappings"

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(("LlamaForCausalLM",), "llama", tensor_parallel=True),
    Architecture(("GraniteForCausalLM",), "granite", tensor_parallel=True),
    Architecture(("MistralForCausalLM",), "mistral", tensor_parallel=True),
    # FMS zeroes the position embedding of every token equal to pad_id (0 by
    # default: StarCoder's <|endoftext|>); HF's class pads by attention mask.
    Architecture(("GPTBigCodeForCausalLM",), "gpt_bigcode", tensor_parallel=True,
                 fms_overrides=(("pad_id", None),)),
    # FMS's own model class, through our port of its loading (model/mixtral.py);
    # its experts run as model/experts.py computes them.
    Architecture(("MixtralForCausalLM",), "mixtral", fms_port="vllm_accel.model.mixtral:FMS_PORT",
                 tensor_parallel=True),
    Architecture(
        ("LlavaNextForConditionalGeneration",), "llava_next",
        vision_adapter=f"{_ADAPTERS}.llava_next:LlavaNextVisionAdapter", tensor_parallel=True,
    ),
    Architecture(
        ("Qwen2_5_VLForConditionalGeneration",), "qwen2_5_vl",
        fms_port="vllm_accel.model.qwen2_5_vl:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.qwen2_5_vl:Qwen2_5_VLVisionAdapter", tensor_parallel=True,
    ),
    Architecture(
        ("MolmoForCausalLM",), "molmo",
        fms_port="vllm_accel.model.molmo:FMS_PORT",
        vision_adapter=f"{_ADAPTERS}.molmo:MolmoVisionAdapter", tensor_parallel=True,
        remote_code=True,
    ),
)


# Architectures FMS maps (its HF registry) that the runner cannot execute
# yet, with the layer kinds it lacks for them: what FMS's registry cannot say.
MISSING_LAYER_KINDS: dict[str, str] = {
    "GptOssForCausalLM": "mixture of experts, attention sinks, sliding-window attention",
    "GraniteMoeHybridForCausalLM": "recurrent state (Mamba2), mixture of experts",
    "BambaForCausalLM": "recurrent state (Mamba2)",
    "GraniteSWAForCausalLM": "sliding-window attention",
    "Qwen3ForCausalLM": "pooling (FMS maps it as an embedding model)",
    "Mistral3ForConditionalGeneration": "the Pixtral vision tower",
    "RobertaForMaskedLM": "pooling (encoder-only models)",
    "BertForMaskedLM": "pooling (encoder-only models)",
    "MPNetForMaskedLM": "pooling (encoder-only models)",
    "RobertaForSequenceClassification": "pooling (encoder-only models)",
    "BertForSequenceClassification": "pooling (encoder-only models)",
    "RobertaForQuestionAnswering": "question answering (encoder-only models)",
}


def find_architecture(hf_names: list[str] | None) -> Architecture:
    """The entry for a config's ``architectures``, or fail naming what is
    missing (a layer kind, for an architecture FMS maps) and what is supported."""
    for name in hf_names or []:
        for arch in ARCHITECTURES:
            if name in arch.hf_names:
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


def check_layer_kinds(hf_config, max_model_len: int) -> None:
    """Fail, naming the setting, for a config that asks for a layer kind the
    runner does not execute yet. Sliding-window attention (Mistral's
    ``sliding_window``) changes nothing while no sequence is longer than the
    window, so it is allowed up to that length."""
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and window < max_model_len:
        raise ValueError(
            f"vllm-accel does not run sliding-window attention yet: "
            f"{hf_config.architectures[0]}'s config sets sliding_window={window}, which "
            f"only takes effect past {window} tokens. Serve it with --max-model-len "
            f"{window} or less (max_model_len is {max_model_len}).")


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
