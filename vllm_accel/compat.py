"""Every use of a private vLLM, FMS or torch API, in one file, or named here.

Pinned to what ``scripts/install.sh`` installs: vLLM 0.33.0, ibm-fms 1.13.1,
torch 2.13.0 (each read from that version's source). An upgrade of any of
them audits this file (and ``patches.py``, which changes their behaviour).
Imports are local to each function: importing this module costs nothing.

The functions below wrap the private calls. One private surface is used in
place instead, because the runner is built on it: vLLM's GPU runner's
``InputBatch`` and ``CachedRequestState`` (``vllm.v1.worker.gpu_input_batch``,
vLLM 0.33.0; vLLM's own V1 runners use them the same way), which hold every
request's tokens, block table, generators and sampling metadata. Read or
written by ``worker/model_runner.py``, ``worker/request_state.py``,
``worker/in_flight.py`` and ``worker/sampling.py``:

- methods: ``add_request``, ``remove_request``, ``condense``,
  ``refresh_metadata``, ``update_async_output_token_ids``,
  ``set_async_sampled_token_ids``, ``block_table[group].get_numpy_array()``;
- attributes: ``req_ids``, ``req_id_to_index``, ``num_reqs``, ``vocab_size``,
  ``token_ids_cpu``, ``is_token_ids``, ``num_tokens_no_spec``,
  ``num_computed_tokens_cpu``, ``generators``, ``sampling_metadata``,
  ``prev_sampled_token_ids``, ``prev_req_id_to_index``;
- ``CachedRequestState`` fields (subclassed as ``RequestState``):
  ``prompt_token_ids``, ``mm_features``, ``num_computed_tokens``,
  ``output_token_ids``, ``in_progress_prompt_logprobs_cpu``.

torch's private APIs (torch 2.13.0) are wrapped below (dynamo's graph counts
and code cache, ``mark_dynamic``/``mark_unbacked``, inductor's cache
counters, ``torch.ops.mkldnn``'s packed linear), set in patches.py 5 and 6
(``torch._inductor.config.compile_threads``,
``torch._dynamo.config.recompile_limit``), or used by ``model/saved_graphs.py``
in place: ``torch._dynamo.guards.CheckFunctionManager`` and the
``aot_compile`` of a ``torch.compile``'d function (graphs saved whole),
``torch._mkldnn`` (the layout of oneDNN-packed weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Callable, Mapping
from typing import Any

# ---- ibm-fms 1.13.1 ---------------------------------------------------------


def register_fms_config_mapping(hf_architecture: str, fms_architecture: str,
                                config_from_hf: Callable[[Any], Any]) -> None:
    """Let ``get_model("hf_pretrained", ...)`` map an HF config of this
    architecture to our FMS config. FMS has no public hook for it:
    ``_FMS_MODEL_CONFIG_REGISTRY`` is what its own models register in."""
    from fms.models.hf.config_utils import _FMS_MODEL_CONFIG_REGISTRY

    _FMS_MODEL_CONFIG_REGISTRY.register_model_arch_info(
        hf_architecture, fms_architecture, lambda hf_config: {"config": config_from_hf(hf_config)})


def fuse_unfused_weights(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """Concatenate q/k/v (weights and biases) and an MLP's gate/up into FMS's
    fused layout, with the adapter steps FMS's LLaMA uses (private in FMS)."""
    from fms.utils import serialization

    return serialization._mlp_glu_unfused_to_fused_adapter_step(
        serialization._attn_unfused_to_fused_step(state_dict))


# ---- vLLM 0.33.0 ------------------------------------------------------------


def limit_modality_to_zero(mm_config, modality: str) -> None:
    """Set a modality's per-prompt limit to 0 the way vLLM parses
    ``--limit-mm-per-prompt '{"video": 0}'`` (its private validator builds the
    options object it keeps)."""
    mm_config.limit_per_prompt.update(type(mm_config)._validate_limit_per_prompt({modality: 0}))


def compile_sampler_logprob_ranks(vocab_size: int, device) -> None:
    """vLLM's sampler ranks logprobs with a torch.compile'd helper,
    ``batched_count_greater_than`` (one graph per process and device, its
    batch size marked unbacked): compile it now, called as the sampler calls
    it (on the logits' device), so that no request pays for it - whether or
    not warmup asked for logprobs."""
    import torch
    from torch._dynamo.decorators import mark_unbacked
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    with torch.inference_mode():  # as sampling runs (dynamo guards on it)
        logprobs = torch.zeros(2, vocab_size, device=device)
        values = torch.zeros(2, 1, device=device)
        mark_unbacked(logprobs, 0)
        mark_unbacked(values, 0)
        batched_count_greater_than(logprobs, values)


@dataclass(frozen=True)
class SplitKvScratch:
    """The scratch of vLLM's Triton attention for its split-KV (3-D) launch:
    each query's KV range cut into ``segments`` attended in parallel, then
    merged. Few sequences then fill the GPU (one decode: 16 times the
    one-pass launch's blocks). Shared by every layer (they run in turn)."""

    output: object  # [rows, heads, segments, head_dim_padded] float32
    max: object  # [rows, heads, segments] float32
    expsum: object  # [rows, heads, segments] float32
    # The launch splits while sequences x query blocks stay at most this many:
    # vLLM's backend's (its 2-D launch's smallest grid over the KV heads).
    max_query_blocks: int
    segments: int = 16

    @classmethod
    def allocate(cls, heads: int, kv_heads: int, head_dim: int, device,
                 segments: int | None = None):
        """The scratch, of ``segments`` segments (None: the field's default)."""
        import torch
        from vllm.v1.attention.ops.triton_unified_attention import MAX_3D_QUERY_LEN

        # Only forwards of at most MAX_3D_QUERY_LEN tokens split: so many rows.
        rows, padded = MAX_3D_QUERY_LEN, 1 << (head_dim - 1).bit_length()
        segments = segments or cls.segments
        new = lambda *shape: torch.empty(shape, dtype=torch.float32, device=device)
        return cls(new(rows, heads, segments, padded), new(rows, heads, segments),
                   new(rows, heads, segments), max(1, 128 // kv_heads), segments)


def triton_paged_attention(query, key_cache, value_cache, out, query_start, seq_lens,
                           block_table, scale: float, window: int = 0,
                           split: SplitKvScratch | None = None, sinks=None) -> None:
    """Causal attention of every sequence of a forward in one launch of vLLM's
    Triton kernel (its Triton attention backend's), into ``out``: query/out
    [tokens, heads, dim]; caches [blocks, block_size, kv_heads, dim];
    query_start [rows + 1], seq_lens [rows], block_table [rows, width], int32;
    ``window``: a query sees its last ``window`` keys (0: all); ``sinks``
    [heads]: a logit per head that joins each softmax's denominator (None:
    none; vLLM's kernel takes them as its gpt-oss layers hand them over).
    The launch depends on the tensors' shapes only (so a CUDA graph per token
    bucket holds it): the longest query it is told is the forward's token
    count. With ``split``, forwards of few tokens (decodes) take the split-KV
    launch, as vLLM's backend decides it from those shapes."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    scratch = {} if split is None else dict(
        seq_threshold_3D=split.max_query_blocks, num_par_softmax_segments=split.segments,
        softmax_segm_output=split.output, softmax_segm_max=split.max,
        softmax_segm_expsum=split.expsum)
    unified_attention(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start,
        max_seqlen_q=query.shape[0], seqused_k=seq_lens,
        max_seqlen_k=block_table.shape[1] * key_cache.shape[1], softmax_scale=scale,
        causal=True,
        window_size=(window - 1, 0) if window else (-1, -1), block_table=block_table, softcap=0,
        q_descale=None, k_descale=None, v_descale=None, sinks=sinks, **scratch)


_unit_scales: dict = {}


def triton_store_kv(key, value, key_cache, value_cache, slots) -> None:
    """Write key/value [tokens, kv_heads, dim] into their cache slots in one
    launch of vLLM's Triton kernel (two index_copy_ launches otherwise)."""
    import torch
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash,
    )

    # Read only for an fp8 cache: unit scales, made once (not while a CUDA
    # graph captures).
    scale = _unit_scales.get(key.device)
    if scale is None:
        scale = _unit_scales[key.device] = torch.ones((), dtype=torch.float32,
                                                      device=key.device)
    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto",
                                   scale, scale)


def mamba2_state_dtypes(model_dtype, cache_config):
    """The dtypes of a Mamba2 layer's state (convolution inputs, SSM state)
    as vLLM's own Mamba2 layers keep them: its ``mamba_cache_dtype`` and
    ``mamba_ssm_cache_dtype`` ("auto": the model's). vLLM's helper for its
    model classes (``vllm/model_executor/layers/mamba/mamba_utils.py``)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    return MambaStateDtypeCalculator.mamba2_state_dtype(
        model_dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype)


# ---- torch 2.13.0 -----------------------------------------------------------


def stateless_process_group(dist_backend: str, prefix_store, rank: int, size: int, timeout):
    """A ``ProcessGroup`` of ``dist_backend`` ("gloo" or "nccl") over
    ``prefix_store``, outside torch.distributed's global state. torch builds
    such groups only through private ``ProcessGroup`` methods."""
    import torch
    from torch.distributed import ProcessGroup

    group = ProcessGroup(prefix_store, rank, size)
    if dist_backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        backend = ProcessGroupGloo(prefix_store, rank, size, timeout=timeout)
        backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif dist_backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = ProcessGroupNCCL(prefix_store, rank, size, options)
        backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        raise NotImplementedError(
            f"vllm-accel cannot build a stateless '{dist_backend}' process group "
            "(used by data and elastic expert parallelism): gloo (cpu) and nccl (cuda) only.")
    group._set_default_backend(backend_type)
    backend._set_sequence_number_for_group()
    group._register_backend(device, backend_type, backend)
    return group



def map_tensors(function, tree):
    """``tree`` (nested tuples/lists/dicts) with ``function`` applied to each tensor."""
    import torch
    from torch.utils import _pytree

    return _pytree.tree_map_only(torch.Tensor, function, tree)


def any_size_along(tensor, dim: int, sizes: tuple[int, int] | None = None) -> None:
    """Compile graphs that take ``tensor`` for any size of ``dim`` (one graph,
    and one compile-cache entry, whatever that size is); ``sizes``: the
    smallest and largest it may take."""
    import torch

    if sizes is None:
        torch._dynamo.mark_dynamic(tensor, dim)
    else:  # both bounds: torch 2.13 fails on a minimum without a maximum
        torch._dynamo.mark_dynamic(tensor, dim, min=sizes[0], max=sizes[1])


def dynamo_graph_count() -> int:
    """Graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def dynamo_code_for(function, frame_locals: dict):
    """The code dynamo runs for a call of ``function`` with these arguments
    (``frame_locals``: parameter name -> value): that of its first cached
    graph whose guards pass, or None. Dynamo keeps the code it rewrote, which
    feeds the frame's tensors to the graph, in the original code's cache."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for entry in _debug_get_cache_entry_list(function.__code__):
        if entry.guard_manager.check(frame_locals):
            return entry.code
    return None


def inductor_cache_counts() -> tuple[int, int, int]:
    """Inductor FX-graph cache (hits, misses, bypasses) in this process so
    far: a bypassed graph is one inductor found it cannot cache (compiled
    anew at every start; its log at INFO says why)."""
    from torch._dynamo.utils import counters

    return tuple(counters["inductor"][f"fxgraph_cache_{outcome}"]
                 for outcome in ("hit", "miss", "bypass"))


def inductor_tuning_benchmarks() -> int:
    """Inductor's own counts of tuning in this process so far: the trial
    runs of coordinate descent (Triton kernels' block sizes) and of combo
    kernels, its algorithm selections and its matmul-padding benchmarks (its
    pick among a kernel's few heuristic configs has no counter)."""
    from torch._dynamo.utils import counters

    return sum(counters["inductor"][name] for name in (
        "coordesc_tuning_bench", "combo_autotune_bench", "select_algorithm_autotune",
        "pad_mm_bench"))


def last_compiled_functions(count: int) -> str:
    """Name and place of the functions behind dynamo's last ``count`` compiles."""
    from torch._dynamo.utils import get_compilation_metrics

    metrics = list(get_compilation_metrics())[-count:]
    return ", ".join(f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" for m in metrics) \
        or "unknown functions"


def onednn_pack_linear_weight(weight):
    """A linear layer's weight [out, in] reordered once into oneDNN's blocked
    layout for this CPU (an ``mkldnn`` tensor), as inductor's freezing pass
    packs constant weights (``torch.ops.mkldnn``, private)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def onednn_linear(x, packed_weight, bias, activation="none", algorithm=""):
    """``activation(x @ weight.T + bias)`` by oneDNN over a weight packed by
    ``onednn_pack_linear_weight``; ``activation`` one of oneDNN's unary
    post-ops as torch names them ("none", "relu", "swish", "gelu" with
    ``algorithm`` "none" or "tanh")."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, activation, [],
                                              algorithm)


def onednn_packs_dtype(dtype) -> bool:
    """Whether oneDNN's packed linear runs ``dtype`` here: float32 always,
    bfloat16 where oneDNN has the CPU instructions for it."""
    import torch

    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False
