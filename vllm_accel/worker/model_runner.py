"""The model runner: turns vLLM scheduler outputs into model calls and tokens.

One runner does it all (continuous batching, chunked prefill, prefix caching):
vLLM's scheduler and KV cache manager decide what runs and where its KV lives;
we keep the per-request state in vLLM's own ``InputBatch`` (which also builds
the sampling metadata and runs logits processors), pack the step's tokens into
one sequence, run it through the FMS model as one or more forwards padded to
token buckets (``step_layout``) and sample with vLLM's ``Sampler``.

A vision-language model always runs on embeddings: images scheduled this step
are encoded (once each, cached by their identifier until vLLM frees them) and
their rows merged at the placeholder positions the step covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.sampling_params import SamplingType
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_accel.buckets import fit_bucket, half_octave_buckets, make_buckets, plan_forwards
from vllm_accel.devices import DeviceBackend
from vllm_accel.model.fms_causal_lm import FmsCausalLM, load_fms_model
from vllm_accel.model import decode_kernel
from vllm_accel.model.paged_attention import attention_context, use_decode_kernel
from vllm_accel.multimodal.encoder import VisionEncoder, merge_embeddings
from vllm_accel.multimodal.inputs import item_tensors
from vllm_accel.multimodal.mm_mappings import get_mm_utils_cls
from vllm_accel.multimodal.mm_mappings.base import MultiModalUtils
from vllm_accel.settings import AccelSettings, env_var_name
from vllm_accel.worker.compile_stats import CompileStats
from vllm_accel.worker.warmup import compile_sampler_helpers
from vllm_accel.worker.step_layout import (
    Forward,
    Placeholder,
    RopePositions,
    StepLayout,
    pack_step,
    placeholder_rows,
)

# A child of the "vllm" logger: same handler, format and VLLM_LOGGING_LEVEL.
logger = init_logger(f"vllm.{__name__}")

# What one more forward costs, in padded tokens (its fixed per-call work:
# Python, one pass over the weights, attention set-up), for cutting a step into
# forwards: a rough estimate from profiles of the tiny and ~90M Llamas on 2
# cores, not tuned.
FORWARD_COST_IN_TOKENS = 32
# Default token buckets, each a graph to compile at start-up (~3 s cold on 2
# cores). Small steps are mostly decodes, one row per running request: they
# double from 8 to 64 so that a decode batch pads at most 2x (the ~90M Llama at
# 32 requests: 1.63x native padded to 64, 2.00x with these buckets). A lone
# decode keeps its own bucket (29 ms as one row, 62-74 ms padded to 8, same
# model). Bigger steps run as forwards of 512 and smaller ones (plan_forwards).
DEFAULT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 512)


def token_buckets(spec: str, max_step: int) -> list[int]:
    """The token buckets for a spec ("" = the defaults), none above the
    largest step the scheduler can send."""
    top = min(max_step, DEFAULT_TOKEN_BUCKETS[-1])
    buckets = (make_buckets(spec, 1, top) if spec
               else [b for b in DEFAULT_TOKEN_BUCKETS if b < top] + [top])
    return [b for b in buckets if b <= max_step] or [max_step]


@dataclass
class PendingSample:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None  # [num_reqs, vocab], InputBatch order; driver only
    discard: np.ndarray  # [num_reqs] bool: partial prefill, token not kept
    prompt_logprobs: dict[str, LogprobsTensors]  # requests whose prompt is done


class AccelModelRunner:
    def __init__(self, vllm_config: VllmConfig, backend: DeviceBackend,
                 settings: AccelSettings, is_driver: bool = True):
        self.vllm_config = vllm_config
        # Tensor parallelism: every rank runs the forward on its shard of the
        # model (FMS all-reduces inside the layers); only the driver (TP rank
        # 0, whose output vLLM's executor reads) computes logits and samples,
        # and it broadcasts the sampled tokens so that every rank's requests
        # stay in step.
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.is_driver = is_driver
        self.model_config = vllm_config.model_config
        self.backend = backend
        self.settings = settings
        self.device = torch.device(backend.device)
        self.dtype = self.model_config.dtype
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.block_size = vllm_config.cache_config.block_size
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        # The scheduler never sends more tokens than this in one step.
        max_step = min(self.max_num_tokens, self.max_num_reqs * self.max_model_len)
        self.token_buckets = token_buckets(settings.token_buckets, max_step)
        # Decode attention runs outside the compiled graphs, so context buckets
        # cost no graphs: by default they step by half octaves, to pad less.
        self.context_buckets = (
            make_buckets(settings.context_buckets, 1, self.max_blocks_per_req)
            if settings.context_buckets else half_octave_buckets(1, self.max_blocks_per_req))
        logger.info(
            "vllm_accel buckets: tokens %s, context blocks %s (block size %d)",
            self.token_buckets, self.context_buckets, self.block_size,
        )

        self.model: FmsCausalLM | None = None
        self.decode_kernel: decode_kernel.DecodeAttentionKernel | None = None  # cpu only
        # Vision-language models only: the architecture's util and the encoder.
        self.mm_utils: MultiModalUtils | None = None
        self.vision_encoder: VisionEncoder | None = None
        self.encoder_cache: dict[str, torch.Tensor] = {}  # image identifier -> embeddings
        # Per request, for models with 3-D positions (M-RoPE) only.
        self.rope_positions: dict[str, RopePositions] = {}
        # Per request with images: their prompt spans, converted once.
        self.placeholders: dict[str, list[Placeholder]] = {}
        # Requests that asked for prompt logprobs and whose prompt is not done.
        self.num_prompt_logprobs: dict[str, int] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        compile_sampler_helpers(self.model_config.get_vocab_size())  # before counting ours
        self.compile_stats = CompileStats()
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            vocab_size=self.model_config.get_vocab_size(),
            block_sizes=[self.block_size],
            max_num_blocks_per_req=[self.max_blocks_per_req],
            logitsprocs=build_logitsprocs(vllm_config, self.device, False, False),
        )
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.pending: PendingSample | None = None

    # ---- start-up -----------------------------------------------------------

    def load_model(self) -> None:
        hf_config = self.model_config.hf_config
        tp_group = None
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            tp_group = get_tp_group().device_group
        fms_model = load_fms_model(self.model_config.model, hf_config, self.dtype,
                                   self.backend.device,
                                   trust_remote_code=self.model_config.trust_remote_code,
                                   tp_group=tp_group)
        mm_utils_cls = get_mm_utils_cls(hf_config)
        if mm_utils_cls is not None:
            self.mm_utils = mm_utils_cls(hf_config, fms_model, self.model_config.model)
            fms_model = self.mm_utils.text_model
        self.model = FmsCausalLM(fms_model)
        if self.tp_size > 1 and not self.model.head_replicated:
            # Only the driver computes logits: a sharded head would need every rank.
            raise ValueError(
                f"vllm-accel tensor parallelism needs the LM head replicated on every "
                f"rank; {type(fms_model).__name__}'s is sharded.")
        # The kernel is the cpu device's own (the graphs stay device-neutral).
        self.decode_kernel = (decode_kernel.load(self.settings.cache_dir / "kernels")
                              if self.backend.device == "cpu" else None)
        use_decode_kernel(self.decode_kernel)
        compile_backend = self.backend.compile_backend if self.backend.compiles else None
        if compile_backend is not None:
            self.compile_stats.configure(self.settings.cache_dir)
            self.model.compile_layers(compile_backend, len(self.token_buckets))
        if self.mm_utils is not None:
            self.vision_encoder = VisionEncoder(self.mm_utils, compile_backend,
                                                self.settings.multimodal_buckets)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        assert self.model is not None
        spec = FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_dim,
            dtype=self.dtype,
        )
        return {f"layers.{i}": spec for i in range(self.model.num_layers)}

    def kv_cache_bytes_per_token(self) -> int:
        specs = self.get_kv_cache_spec().values()
        return sum(s.page_size_bytes for s in specs) // self.block_size

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        assert self.model is not None
        self.num_blocks = kv_cache_config.num_blocks
        shape = (self.num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [
            (_zeros(shape, self.dtype, self.device), _zeros(shape, self.dtype, self.device))
            for _ in range(self.model.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            2 * sum(k.numel() * k.element_size() for k, _ in self.kv_caches) / 2**30,
        )

    # ---- per step -----------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT

        batch = self.input_batch
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int64
        )
        start = batch.num_computed_tokens_cpu[: batch.num_reqs].astype(np.int64)
        step = pack_step(
            batch.token_ids_cpu, batch.block_table[0].get_numpy_array(), num_scheduled, start,
            self.block_size, self._plan_forwards, self._context_bucket,
            [self.rope_positions[r] for r in batch.req_ids] if self.rope_positions else None,
        )
        with self.compile_stats.cache_scope():
            inputs = step.input_ids.to(self.device)
            if self.mm_utils is not None:
                self._encode_scheduled_images(scheduler_output)
                inputs = self._merged_embeddings(step, inputs)
            parts = [self._run_forward(fwd, inputs) for fwd in step.forwards]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        logits, prompt_logprobs = None, {}
        if self.is_driver:
            logits = self.model.compute_logits(hidden[0, step.last_token.to(self.device)]).cpu()
            prompt_logprobs = self._prompt_logprobs(step, hidden, scheduler_output)

        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids])
        self.pending = PendingSample(
            scheduler_output=scheduler_output,
            logits=logits,
            discard=start + num_scheduled < num_tokens,
            prompt_logprobs=prompt_logprobs,
        )
        return None

    def _run_forward(self, forward: Forward, inputs: torch.Tensor) -> torch.Tensor:
        """Hidden states of the step's tokens [forward.begin, forward.end);
        ``inputs`` holds the whole step's token ids or embeddings."""
        tokens = inputs
        if forward.begin != 0 or forward.bucket != inputs.shape[1]:
            # A fresh padded tensor, not a view at an offset: compiled graphs
            # assume (and guard on) aligned inputs.
            tokens = inputs.new_zeros((1, forward.bucket) + inputs.shape[2:])
            tokens[:, : forward.end - forward.begin] = inputs[:, forward.begin : forward.end]
        with attention_context(forward.attn_metadata):
            hidden = self.model(tokens, forward.positions.to(self.device), self.kv_caches)
        self.compile_stats.after_step(f"a forward of {forward.bucket} tokens")
        return hidden[:, : forward.end - forward.begin]

    def _prompt_logprobs(self, step: StepLayout, hidden: torch.Tensor,
                         scheduler_output: SchedulerOutput) -> dict[str, LogprobsTensors]:
        """Logprobs of each prompt token given the ones before it, filled in
        chunk by chunk; returned for a request once its whole prompt is done
        (vLLM's semantics; such requests never read the prefix cache)."""
        finished = {}
        # Driver only (see __init__); other ranks drop the bookkeeping.
        for req_id, num_logprobs in list(self.num_prompt_logprobs.items()):
            count = scheduler_output.num_scheduled_tokens.get(req_id)
            if count is None:  # not scheduled this step
                continue
            state = self.requests[req_id]
            prompt = state.prompt_token_ids
            if state.in_progress_prompt_logprobs_cpu is None:
                state.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(
                    len(prompt) - 1, num_logprobs + 1)
            tensors = state.in_progress_prompt_logprobs_cpu
            start = state.num_computed_tokens
            # Position i predicts prompt token i + 1: the last prompt token predicts none.
            num_logits = min(count, len(prompt) - 1 - start)
            if count > len(prompt) - 1 - start:
                finished[req_id] = tensors
                del self.num_prompt_logprobs[req_id]
                state.in_progress_prompt_logprobs_cpu = None
            if num_logits <= 0:
                continue
            row = self.input_batch.req_id_to_index[req_id]
            first = int(step.firsts[np.flatnonzero(step.rows == row)[0]])
            logits = self.model.compute_logits(hidden[0, first : first + num_logits])
            if self.model_config.logprobs_mode not in ("raw_logits", "processed_logits"):
                logits = self.sampler.compute_logprobs(logits)
            targets = torch.tensor(prompt[start + 1 : start + 1 + num_logits], device=logits.device)
            token_ids, logprobs, ranks, *_ = self.sampler.gather_logprobs(
                logits, num_logprobs, targets)
            chunk = slice(start, start + num_logits)
            tensors.logprob_token_ids[chunk] = token_ids.cpu()
            tensors.logprobs[chunk] = logprobs.cpu()
            tensors.selected_token_ranks[chunk] = ranks.cpu()
        return finished

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self.pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        pending, self.pending = self.pending, None
        batch = self.input_batch
        output = None
        if self.is_driver:
            output = self._sample(pending, grammar_output)
            sampled_ids = output.sampled_token_ids.to(torch.int64)
        else:
            sampled_ids = torch.empty((batch.num_reqs, 1), dtype=torch.int64)
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            sampled_ids = get_tp_group().broadcast(sampled_ids.contiguous(), src=0)

        sampled = sampled_ids.tolist()
        for i in np.flatnonzero(pending.discard):
            sampled[i] = []
        for i, token_ids in enumerate(sampled):
            if token_ids:
                end = batch.num_tokens_no_spec[i]
                batch.token_ids_cpu[i, end] = token_ids[0]
                batch.is_token_ids[i, end] = True
                batch.num_tokens_no_spec[i] = end + 1
                self.requests[batch.req_ids[i]].output_token_ids.append(token_ids[0])

        self.compile_stats.after_step("sampling")  # vLLM's sampler compiles helpers too
        logprobs = output.logprobs_tensors if output is not None else None
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=sampled,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict=pending.prompt_logprobs,
        )

    def _sample(self, pending: PendingSample, grammar_output: GrammarOutput | None):
        batch = self.input_batch
        if grammar_output is not None:
            apply_grammar_bitmask(pending.scheduler_output, grammar_output, batch, pending.logits)

        # A seeded request whose token is thrown away (a prefill chunk that does
        # not end the prompt) must not advance its generator.
        saved_rng = {
            i: g.get_state() for i, g in batch.generators.items() if pending.discard[i]
        }
        output = self.sampler(logits=pending.logits, sampling_metadata=batch.sampling_metadata)
        for i, state in saved_rng.items():
            batch.generators[i].set_state(state)
        return output

    # ---- multimodal ---------------------------------------------------------

    def _encode_scheduled_images(self, scheduler_output: SchedulerOutput) -> None:
        """Encode the images whose placeholders this step reaches (prefill only),
        each once: vLLM schedules an image again only after freeing it."""
        for image_id in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(image_id, None)
        ids, items = [], []
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = self.requests[req_id].mm_features[index]
                if feature.identifier not in self.encoder_cache and feature.identifier not in ids:
                    ids.append(feature.identifier)
                    items.append(item_tensors(feature.data))
        if items:
            self.encoder_cache.update(zip(ids, self.vision_encoder.encode(items)))

    def _merged_embeddings(self, step: StepLayout, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings with image rows at the placeholder positions this
        step covers (see step_layout.placeholder_rows)."""
        placeholders = [self.placeholders.get(req_id, []) for req_id in self.input_batch.req_ids]
        is_mm, slices = placeholder_rows(step, placeholders)
        embeds = self.mm_utils.embed_tokens(input_ids)
        if not slices:
            return embeds
        rows = torch.cat([self.encoder_cache[key][lo:hi] for key, lo, hi in slices])
        return merge_embeddings(embeds, rows, torch.from_numpy(is_mm))

    def reset_encoder_cache(self) -> None:
        self.encoder_cache.clear()

    # ---- helpers ------------------------------------------------------------

    def _plan_forwards(self, num_tokens: int) -> list[int]:
        return plan_forwards(num_tokens, self.token_buckets, FORWARD_COST_IN_TOKENS)

    def _context_bucket(self, blocks: int) -> int:
        return fit_bucket(self.context_buckets, blocks, "context blocks",
                          env_var_name("context_buckets"))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Mirror the scheduler's view of the requests into the InputBatch."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.rope_positions.pop(req_id, None)
            self.placeholders.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)

        if scheduler_output.new_block_ids_to_zero:
            ids = torch.tensor(scheduler_output.new_block_ids_to_zero)
            for key_cache, value_cache in self.kv_caches:
                key_cache[ids] = 0
                value_cache[ids] = 0

        # Requests not scheduled this step (preempted or waiting) leave the batch
        # but keep their state.
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for req_id in set(batch.req_id_to_index) - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                prompt_embeds=new.prompt_embeds,
                prompt_is_token_ids=new.prompt_is_token_ids,
                mm_features=new.mm_features,
                sampling_params=params,
                pooling_params=None,
                generator=generator,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            if params is not None and params.prompt_logprobs is not None:
                # -1: the whole vocabulary.
                self.num_prompt_logprobs[new.req_id] = (
                    self.input_batch.vocab_size if params.prompt_logprobs == -1
                    else params.prompt_logprobs)
            if new.mm_features:
                self.placeholders[new.req_id] = [_placeholder(f) for f in new.mm_features]
            if self.mm_utils is not None and self.mm_utils.uses_3d_positions:
                self.rope_positions[new.req_id] = RopePositions(*self.mm_utils.rope_positions(
                    new.prompt_token_ids, [item_tensors(f.data) for f in new.mm_features]))
            to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)

            index = batch.req_id_to_index.get(req_id)
            if index is None:  # resumed, or back after a step without tokens
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU from calloc'd memory, which the OS zero-fills
    page by page on first touch: a 4 GiB KV cache then costs nothing at start-up
    (torch.zeros writes every byte first: 1-2 s for 4 GiB on a quiet 2-core machine)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    memory = np.zeros(nbytes + 64, dtype=np.uint8)
    offset = -memory.ctypes.data % 64  # cache-line aligned, as torch allocates
    return torch.from_numpy(memory[offset : offset + nbytes]).view(dtype).view(shape)


def _placeholder(feature) -> Placeholder:
    """A vLLM ``MultiModalFeatureSpec``'s prompt span."""
    place = feature.mm_position
    is_embed = None if place.is_embed is None else place.is_embed.cpu().numpy().astype(bool)
    return Placeholder(feature.identifier, place.offset, place.length, is_embed)
