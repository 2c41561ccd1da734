"""The model runner: turns vLLM scheduler outputs into model calls and tokens.

One runner does it all (continuous batching, chunked prefill, prefix caching):
vLLM's scheduler and KV cache manager decide what runs and where its KV lives;
we keep the per-request state in vLLM's own ``InputBatch`` (which also builds
the sampling metadata and runs logits processors), pack the step's tokens into
one sequence padded to a token bucket, run the FMS model and sample with
vLLM's ``Sampler``.

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
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_accel.devices import DeviceBackend
from vllm_accel.model.fms_causal_lm import FmsCausalLM
from vllm_accel.model.paged_attention import (
    PagedAttentionMetadata,
    PrefillChunk,
    attention_context,
    causal_context_mask,
)
from vllm_accel.settings import AccelSettings, env_var_name
from vllm_accel.worker.buckets import find_bucket, make_buckets
from vllm_accel.worker.compile_stats import CompileStats

# A child of the "vllm" logger: same handler, format and VLLM_LOGGING_LEVEL.
logger = init_logger(f"vllm.{__name__}")


@dataclass
class StepInputs:
    """One step's tokens packed into a sequence padded to a token bucket."""

    input_ids: torch.Tensor  # [1, padded_tokens]
    positions: torch.Tensor  # [1, padded_tokens]
    attn_metadata: PagedAttentionMetadata
    last_token: torch.Tensor  # [num_reqs] packed index of each request's last token
    num_tokens: int  # before padding
    # Per packed request (decodes first): InputBatch row, first packed token,
    # number of tokens, and the position of its first token in its sequence.
    rows: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    starts: np.ndarray


@dataclass
class PendingSample:
    """What execute_model leaves for sample_tokens."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor  # [num_reqs, vocab], InputBatch order
    discard: np.ndarray  # [num_reqs] bool: partial prefill, token not kept


class AccelModelRunner:
    def __init__(self, vllm_config: VllmConfig, backend: DeviceBackend,
                 settings: AccelSettings):
        self.vllm_config = vllm_config
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
        buckets = make_buckets(settings.token_buckets, 1, max_step)
        self.token_buckets = [b for b in buckets if b <= max_step] or [max_step]
        self.context_buckets = make_buckets(settings.context_buckets, 1, self.max_blocks_per_req)
        logger.info(
            "vllm_accel buckets: tokens %s, context blocks %s (block size %d)",
            self.token_buckets, self.context_buckets, self.block_size,
        )

        self.model: FmsCausalLM | None = None
        self.encoder_cache: dict[str, torch.Tensor] = {}  # image identifier -> embeddings
        self.images_encoded = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
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
        self.model = FmsCausalLM.load(
            self.model_config.model,
            self.model_config.hf_config,
            self.dtype,
            self.backend.device,
        )
        if self.backend.compiles:
            self.compile_stats.configure(self.settings.cache_dir)
            self.model.compile_layers(self.backend.compile_backend, len(self.token_buckets))
            if self.model.mm_utils is not None:
                self.model.mm_utils.compile_encoder(self.backend.compile_backend)

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
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
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
        step = self._pack_step(num_scheduled, start)
        inputs = step.input_ids.to(self.device)
        if self.model.mm_utils is not None:
            self._encode_scheduled_images(scheduler_output)
            inputs = self._merged_embeddings(step, inputs)

        with attention_context(step.attn_metadata):
            hidden = self.model(inputs, step.positions.to(self.device), self.kv_caches)
        self.compile_stats.after_forward(step.input_ids.shape[1])
        logits = self.model.compute_logits(hidden[0, step.last_token.to(self.device)]).cpu()

        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids])
        self.pending = PendingSample(
            scheduler_output=scheduler_output,
            logits=logits,
            discard=start + num_scheduled < num_tokens,
        )
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self.pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        pending, self.pending = self.pending, None
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

        sampled = output.sampled_token_ids.tolist()
        for i in np.flatnonzero(pending.discard):
            sampled[i] = []
        for i, token_ids in enumerate(sampled):
            if token_ids:
                end = batch.num_tokens_no_spec[i]
                batch.token_ids_cpu[i, end] = token_ids[0]
                batch.is_token_ids[i, end] = True
                batch.num_tokens_no_spec[i] = end + 1
                self.requests[batch.req_ids[i]].output_token_ids.append(token_ids[0])

        logprobs = output.logprobs_tensors
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=sampled,
            logprobs=logprobs.tolists() if logprobs is not None else None,
            prompt_logprobs_dict={},
        )

    # ---- multimodal ---------------------------------------------------------

    def _encode_scheduled_images(self, scheduler_output: SchedulerOutput) -> None:
        """Encode the images whose placeholders this step reaches (prefill only),
        each once: vLLM schedules an image again only after freeing it."""
        for image_id in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(image_id, None)
        mm = self.model.mm_utils
        ids, items = [], []
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = self.requests[req_id].mm_features[index]
                if feature.identifier not in self.encoder_cache and feature.identifier not in ids:
                    ids.append(feature.identifier)
                    items.append(mm.item_tensors(feature.data))
        if items:
            self.encoder_cache.update(zip(ids, mm.encode(items)))
            self.images_encoded += len(items)

    def _merged_embeddings(self, step: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings with image rows placed at the absolute positions of
        their placeholders, also when a prefill chunk cuts through an image."""
        is_image = torch.zeros(input_ids.shape[1], dtype=torch.bool)
        chunks = []
        for row, first, count, start in zip(step.rows, step.firsts, step.counts, step.starts):
            end = start + count
            for feature in self.requests[self.input_batch.req_ids[row]].mm_features:
                place = feature.mm_position
                lo, hi = max(start, place.offset), min(end, place.offset + place.length)
                if lo >= hi:
                    continue
                if place.is_embed is not None:
                    raise NotImplementedError("placeholders with non-embedding tokens")
                is_image[first + lo - start : first + hi - start] = True
                chunks.append(self.encoder_cache[feature.identifier][lo - place.offset :
                                                                      hi - place.offset])
        mm = self.model.mm_utils
        embeds = mm.embed_tokens(input_ids)
        if not chunks:
            return embeds
        return mm.merge(embeds, torch.cat(chunks), is_image)

    def reset_encoder_cache(self) -> None:
        self.encoder_cache.clear()

    # ---- helpers ------------------------------------------------------------

    def _pack_step(self, num_scheduled: np.ndarray, start: np.ndarray) -> StepInputs:
        """Pack decodes, then prefill chunks, into one padded token sequence."""
        bs = self.block_size
        is_decode = num_scheduled == 1
        order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
        counts = num_scheduled[order]
        ends = np.cumsum(counts)
        firsts = ends - counts
        total = int(ends[-1])
        padded = self._token_bucket(total)

        row_of_token = np.repeat(order, counts)
        pos = start[row_of_token] + np.arange(total) - np.repeat(firsts, counts)
        block_table = self.input_batch.block_table[0].get_numpy_array()
        input_ids = np.zeros(padded, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        slots = np.zeros(padded, dtype=np.int64)  # padding writes into block 0
        input_ids[:total] = self.input_batch.token_ids_cpu[row_of_token, pos]
        positions[:total] = pos
        slots[:total] = block_table[row_of_token, pos // bs] * bs + pos % bs
        last_token = np.empty(len(order), dtype=np.int64)
        last_token[order] = ends - 1

        num_decodes = int(is_decode.sum())
        decode_rows = order[:num_decodes]
        context_lens = start[decode_rows] + 1
        width = self._context_bucket(cdiv(int(context_lens.max(initial=1)), bs))
        decode_mask = np.arange(width * bs)[None, :] < context_lens[:, None]
        prefills = []
        for row, first, count in zip(order[num_decodes:], firsts[num_decodes:],
                                     counts[num_decodes:]):
            context_len = int(start[row] + count)
            blocks = cdiv(context_len, bs)
            prefills.append(PrefillChunk(
                start=int(first),
                end=int(first + count),
                block_table=torch.from_numpy(block_table[row : row + 1, :blocks].astype(np.int64)),
                mask=causal_context_mask(
                    torch.from_numpy(positions[first : first + count][None]),
                    torch.tensor([context_len]),
                    blocks * bs,
                ),
            ))
        metadata = PagedAttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            num_decodes=num_decodes,
            decode_block_table=torch.from_numpy(block_table[decode_rows, :width].astype(np.int64)),
            decode_mask=torch.from_numpy(decode_mask[:, None, None, :]),
            prefills=prefills,
        )
        return StepInputs(
            input_ids=torch.from_numpy(input_ids)[None],
            positions=torch.from_numpy(positions)[None],
            attn_metadata=metadata,
            last_token=torch.from_numpy(last_token),
            num_tokens=total,
            rows=order,
            firsts=firsts,
            counts=counts,
            starts=start[order],
        )

    def _token_bucket(self, num_tokens: int) -> int:
        bucket = find_bucket(self.token_buckets, num_tokens)
        if bucket is None:
            logger.warning(
                "vllm_accel: a step of %d tokens exceeds every token bucket %s; running "
                "it unpadded (a new compiled graph when compiling). Add a bucket >= %d "
                "to %s.", num_tokens, self.token_buckets, num_tokens,
                env_var_name("token_buckets"),
            )
            return num_tokens
        return bucket

    def _context_bucket(self, blocks: int) -> int:
        bucket = find_bucket(self.context_buckets, blocks)
        if bucket is None:
            logger.warning(
                "vllm_accel: a context of %d blocks exceeds every context bucket %s; "
                "attention runs unpadded. Add a bucket >= %d to %s.",
                blocks, self.context_buckets, blocks, env_var_name("context_buckets"),
            )
            return blocks
        return bucket

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Mirror the scheduler's view of the requests into the InputBatch."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
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
