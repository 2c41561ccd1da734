"""The model runner: turns vLLM scheduler outputs into model calls and tokens.

One runner does it all (continuous batching, chunked prefill, prefix caching):
vLLM's scheduler and KV cache manager decide what runs and where its KV lives;
``request_state`` mirrors the requests into vLLM's own ``InputBatch`` (which
also builds the sampling metadata and runs logits processors); the runner packs
the step's tokens into one sequence, runs it through the FMS model as one or
more forwards padded to token buckets (``step_layout``), each under its own
forward context, and samples with vLLM's ``Sampler`` (``sampling``).

A vision-language model always runs on embeddings: images scheduled this step
are encoded and merged at their placeholder positions (``images``). A pooling
model returns vLLM's pooler outputs instead of sampling (``pooling``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_accel.architectures import find_architecture, layer_windows
from vllm_accel.buckets import (context_buckets, fit_bucket, plan_forwards, token_buckets,
                                token_count_costs)
from vllm_accel.compat import SplitKvScratch, mamba2_state_dtypes
from vllm_accel.devices import DeviceBackend
from vllm_accel.forward_context import ForwardContext, set_forward_context
from vllm_accel.kernels import NO_KERNELS, CpuKernels
from vllm_accel.log import get_logger
from vllm_accel.model.fms_causal_lm import FmsCausalLM
from vllm_accel.model.fms_encoder import FmsEncoder
from vllm_accel.model.mamba2 import RecurrentLayout
from vllm_accel.model.paged_attention import AttentionLayouts, TableShape
from vllm_accel.multimodal.encoder import VisionEncoder
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.settings import AccelSettings, env_var_name
from vllm_accel.worker.compile_stats import CompileStats
from vllm_accel.worker.cuda_graphs import ForwardGraphs
from vllm_accel.worker.forward_inputs import ForwardInputs, device_forward
from vllm_accel.worker.images import MultimodalRows, StepImages
from vllm_accel.worker.in_flight import (NO_TOKENS_IN_FLIGHT, InFlightOutput, copy_in_flight,
                                        in_forward, tokens_in_flight)
from vllm_accel.worker.kv_cache_groups import KvCacheGroups
from vllm_accel.worker.model_loader import load_model
from vllm_accel.worker.pooling import (PoolingHead, batch_order, encode_step,
                                      encoder_token_buckets)
from vllm_accel.worker.prompt_logprobs import compute_prompt_logprobs
from vllm_accel.worker.request_state import RequestStates
from vllm_accel.worker.sampling import PendingSample, sample_step
from vllm_accel.worker.step_layout import AttentionGroup, BucketedForward, pack_step

logger = get_logger(__name__)


class AccelModelRunner:
    def __init__(self, vllm_config: VllmConfig, backend: DeviceBackend,
                 settings: AccelSettings, is_driver: bool = True):
        self.vllm_config = vllm_config
        # Tensor parallelism: every rank runs the forward on its shard (FMS
        # all-reduces inside the layers); only the driver (rank 0, whose output
        # vLLM's executor reads) computes logits and samples (sample_step).
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
        self.is_pooling = self.model_config.runner_type == "pooling"
        encoder_only = self.is_pooling and find_architecture(
            self.model_config.hf_config.architectures).encoder is not None
        if encoder_only:
            self.token_buckets = encoder_token_buckets(
                settings.token_buckets, max_step, self.max_model_len,
                backend.prefers_large_forwards)
        else:
            self.token_buckets = token_buckets(settings.token_buckets, max_step)
        self.context_buckets = context_buckets(settings.context_buckets, self.max_blocks_per_req)
        # Each bucket's forward cost, to cut steps into forwards (plan_forwards):
        # by token counts, or measured at warmup (forward_plan=measured).
        self.forward_costs = token_count_costs(self.token_buckets)
        # While warmup times forwards: bucket -> seconds of each forward run.
        self.forward_times: dict[int, list[float]] | None = None
        # Attention in one launch per forward (cuda) reads a table of fixed
        # shape per token bucket: one graph per bucket.
        self.table_shape = (TableShape(self.max_num_reqs, self.context_buckets[-1])
                            if backend.attends_in_one_launch else None)
        logger.info(
            "vllm_accel buckets: tokens %s (%s), context blocks %s (block size %d)",
            self.token_buckets, "one graph shared by those above 1"
            if backend.shares_layer_graphs(encoder_only) else "a graph each",
            self.context_buckets, self.block_size,
        )

        self.model: FmsCausalLM | None = None
        # Pooling models only: vLLM's pooler (after load_model), and the
        # model when it is encoder-only (then ``model`` stays None).
        self.pooling: PoolingHead | None = None
        self.encoder: FmsEncoder | None = None
        self.kernels: CpuKernels = NO_KERNELS  # cpu: our C++ kernels, after load_model
        self.graphs: ForwardGraphs | None = None  # cuda only, after warmup
        # Each token bucket's inputs in one device buffer (cuda, after load_model).
        self.forward_inputs: dict[int, ForwardInputs] | None = None
        # Vision-language models only: the adapter, the encoder, the step's images.
        self.vision: VisionAdapter | None = None
        self.vision_encoder: VisionEncoder | None = None
        self.images: StepImages | None = None
        # The KV cache: groups, tensors, layouts (each layer's window and kind).
        self.kv_cache = KvCacheGroups([0], {})
        self.compile_stats = CompileStats()
        self._new_input_batch([self.block_size], [self.max_blocks_per_req])
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode)
        self.pending: PendingSample | None = None
        # vLLM's async scheduling (in_flight.py): a step starts before the
        # previous one's tokens reach the host.
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.tokens_from_device = 0  # decode inputs that never went through the host

    def _new_input_batch(self, block_sizes: list[int], max_blocks: list[int]) -> None:
        """vLLM's ``InputBatch`` (a block table per KV group), our requests over it; empty."""
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            vocab_size=self.model_config.get_vocab_size(),
            block_sizes=block_sizes,
            max_num_blocks_per_req=max_blocks,
            logitsprocs=build_logitsprocs(self.vllm_config, self.device, False, False),
            is_pooling_model=self.is_pooling,
        )
        self.requests = RequestStates(self.input_batch, self.device, self.vision, self.pooling)

    # ---- start-up -----------------------------------------------------------

    def load_model(self) -> None:
        tp_group = None
        if self.tp_size > 1:
            from vllm.distributed import get_tp_group

            tp_group = get_tp_group().device_group
        loaded = load_model(self.model_config, self.backend, self.settings, self.token_buckets,
                            self.compile_stats, tp_group)
        self.kernels = loaded.kernels
        if isinstance(loaded.model, FmsEncoder):  # no KV cache, no decoder
            self.encoder = loaded.model
            self.pooling = self.requests.pooling = PoolingHead(
                self.vllm_config, loaded.model.classify
                if loaded.model.classification_head is not None else None)
            self.kv_cache = KvCacheGroups([], {})
            return
        self.model = loaded.model
        if self.is_pooling:
            self.pooling = self.requests.pooling = PoolingHead(self.vllm_config, None)
        arch = find_architecture(self.model_config.architectures)
        windows = layer_windows(arch, self.model_config.hf_text_config, self.model.num_layers)
        self.kv_cache = KvCacheGroups.for_context(windows, self.model.recurrent, self.max_model_len)
        if self.model.recurrent:
            # Recurrent state in the dtypes vLLM's cache config names (before
            # any forward: the layer graphs take them as constants).
            conv, ssm = mamba2_state_dtypes(self.dtype, self.vllm_config.cache_config)
            for mixer in self.model.recurrent.values():
                mixer.conv_dtype, mixer.ssm_dtype = conv, ssm
        if loaded.vision is not None:
            self.vision, self.vision_encoder = loaded.vision, loaded.vision_encoder
            self.requests.vision = self.vision
            self.images = StepImages(self.vision, self.vision_encoder, self.tp_size,
                                     self.device, self.dtype, self.model.hidden_size)
        if self.table_shape is not None:
            model = self.model
            self._split_kv = SplitKvScratch.allocate(model.num_heads, model.num_kv_heads,
                                                     model.head_dim, self.device)
            self.forward_inputs = self._new_forward_inputs()

    def _new_forward_inputs(self) -> dict[int, ForwardInputs]:
        """Each token bucket's device inputs, a layout per attention group."""
        axes = 3 if self.vision is not None and self.vision.uses_3d_positions else 1
        return {bucket: ForwardInputs(bucket, self.table_shape.rows(bucket),
                                      self.table_shape.width, axes, self.device,
                                      [window for _, window in self.kv_cache.layouts],
                                      self._split_kv, len(self.kv_cache.state_groups))
                for bucket in self.token_buckets}

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        if self.encoder is not None:
            return {}
        return self.kv_cache.specs(self.block_size, self.model.num_kv_heads, self.model.head_dim,
                                   self.dtype, self.max_model_len)

    def kv_cache_bytes_per_token(self) -> int:
        return KvCacheGroups.bytes_per_token(self.get_kv_cache_spec(), self.block_size,
                                             self.max_model_len)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.num_blocks = kv_cache_config.num_blocks
        if self.encoder is not None:  # no KV cache: requests hold no blocks
            self._new_input_batch([], [])
            return
        block_tables = self.kv_cache.allocate(
            kv_cache_config, self.block_size, self.model.num_kv_heads, self.model.head_dim,
            self.dtype, self.device, self.max_blocks_per_req)
        if block_tables is not None:  # a block table per KV cache group
            self._new_input_batch(*block_tables)
        layouts = self.kv_cache.layouts
        if self.forward_inputs is not None and (len(layouts) > 1 or self.kv_cache.state_groups):
            self.forward_inputs = self._new_forward_inputs()
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)%s",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.kv_cache.nbytes() / 2**30,
            f"; attention layouts (KV cache group, window): {layouts}" if len(layouts) > 1
            else "",
        )

    # ---- per step -----------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.requests.update(scheduler_output)
        if scheduler_output.new_block_ids_to_zero:
            self.kv_cache.zero(scheduler_output.new_block_ids_to_zero)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT

        batch = self.input_batch
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int64
        )
        if self.encoder is not None:
            return self._pool(encode_step(self, num_scheduled), num_scheduled)
        start = batch.num_computed_tokens_cpu[: batch.num_reqs].astype(np.int64)
        attention = [AttentionGroup(batch.block_table[g].get_numpy_array(), window)
                     for g, window in self.kv_cache.layouts]
        step = pack_step(
            batch.token_ids_cpu, attention, num_scheduled, start,
            self.block_size, self._plan_forwards, self._context_bucket,
            [s.rope_positions for s in self.requests.in_batch_order()]
            if self.vision and self.vision.uses_3d_positions else None,
            self.table_shape,
        )
        in_flight = (tokens_in_flight(batch, step.rows, step.first_tokens, step.input_ids)
                     if self.async_scheduling else NO_TOKENS_IN_FLIGHT)
        self.tokens_from_device += len(in_flight[0])
        # Prompt logprobs read every prompt token's hidden state, sampling only
        # the logits of each request's last token (computed per forward).
        keep_hidden = self.is_pooling or any(self.requests[r].prompt_logprobs_pending is not None
                                             for r in scheduler_output.num_scheduled_tokens)
        multimodal = None
        if self.images is not None:
            with set_forward_context(self.forward_context()):
                self.images.encode_scheduled(scheduler_output, self.requests)
            multimodal = self.images.rows(step, self.requests)
        run = self._run_forward if self.forward_times is None else self._timed_forward
        state_tables = [batch.block_table[g].get_numpy_array() for g in self.kv_cache.state_groups]
        outputs = [run(fwd, in_flight, multimodal, keep_hidden,
                       copy_outputs=len(step.forwards) > 1, state_tables=state_tables)
                   for fwd in step.forwards]
        hidden = None
        if keep_hidden:
            parts = [h for h, _ in outputs]
            hidden = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.pooling is not None:
            order = torch.from_numpy(batch_order(step.first_tokens, step.counts, step.rows))
            return self._pool(hidden[0, order.to(hidden.device)], num_scheduled)
        logits, prompt_logprobs = None, {}
        if self.is_driver:
            logits = step.in_batch_order([lg for _, lg in outputs])
            if keep_hidden:  # the LM head may run by our kernel: in a forward's context
                with set_forward_context(self.forward_context()):
                    prompt_logprobs = compute_prompt_logprobs(
                        step, hidden, scheduler_output, self.requests, self.input_batch,
                        self.model.compute_logits, self.sampler, self.model_config.logprobs_mode)

        self.pending = PendingSample(
            scheduler_output=scheduler_output,
            logits=logits,
            discard=start + num_scheduled < batch.num_tokens_no_spec[: batch.num_reqs],
            prompt_logprobs=prompt_logprobs,
        )
        return None

    def _run_forward(self, forward: BucketedForward, in_flight: tuple[np.ndarray, np.ndarray],
                     multimodal: MultimodalRows | None, keep_hidden: bool, copy_outputs: bool,
                     state_tables: list[np.ndarray] | None = None,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits of the requests whose last token is among the step's
        tokens [forward.begin, forward.end) (driver), and those tokens' hidden
        states if ``keep_hidden``. ``copy_outputs``: a CUDA graph's outputs are
        overwritten by its next replay; copy them when the step replays again
        before reading them. ``state_tables``: the block tables of the
        recurrent KV cache groups (none: no layer keeps recurrent state)."""
        in_flight = in_forward(in_flight, forward.begin, forward.end)
        recurrent = forward.recurrent_layout(state_tables) if state_tables else None
        if self.forward_inputs is not None:
            inputs = self.forward_inputs[forward.bucket].send(forward, in_flight, recurrent)
        else:
            inputs = device_forward(forward, in_flight, self.device, recurrent)
        if n := inputs.num_in_flight:
            copy_in_flight(inputs.input_ids, self.input_batch.prev_sampled_token_ids,
                           inputs.in_flight_targets[:n], inputs.in_flight_sources[:n])
        model_inputs = inputs.input_ids
        if self.images is not None:
            model_inputs = self.images.embeddings(forward, model_inputs, multimodal)
        count = forward.end - forward.begin
        graphs = self.graphs
        replayed = graphs is not None and graphs.serves(forward.bucket, inputs.recurrent)
        if replayed:
            hidden, logits = graphs.replay(forward.bucket, model_inputs)
        else:
            hidden, logits = self.model_call(model_inputs, inputs.positions, inputs.metadata,
                                             inputs.logit_rows, tokens=count,
                                             recurrent=inputs.recurrent)
            self.compile_stats.after_step(f"a forward of {forward.bucket} tokens")
        hidden = hidden[:, :count] if keep_hidden else None
        logits = None if logits is None else logits[: inputs.num_logits]
        if replayed and copy_outputs:
            hidden, logits = (None if t is None else t.clone() for t in (hidden, logits))
        return hidden, logits

    def _timed_forward(self, forward: BucketedForward, *args, **kwargs):
        """``_run_forward``, its time (device work included) added to
        ``forward_times`` (warmup.measure_forward_costs)."""
        self.backend.synchronize()
        started = time.perf_counter()
        outputs = self._run_forward(forward, *args, **kwargs)
        self.backend.synchronize()
        self.forward_times.setdefault(forward.bucket, []).append(time.perf_counter() - started)
        return outputs

    def model_call(self, inputs: torch.Tensor, positions: torch.Tensor,
                   metadata: AttentionLayouts, logit_rows: torch.Tensor,
                   tokens: int | None = None, recurrent: RecurrentLayout | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward under a layout (one per attention group): hidden
        states [1, tokens, hidden] and
        the logits of the tokens ``logit_rows`` (driver only). What the CUDA
        graphs capture: on a GPU the LM head runs inside the graph too.
        ``tokens``: the bucket's rows that hold the forward's tokens (linears
        skip the rest, padding); None: every row (a capture). ``recurrent``:
        where the recurrent layers' states are (models that have them)."""
        bucket = inputs.shape[1]
        context = self.forward_context(attention=metadata, recurrent=recurrent)
        with set_forward_context(context.padded(bucket, bucket if tokens is None else tokens)):
            hidden = self.model(inputs, positions, self.kv_cache.layers)
        with set_forward_context(context):  # the head's rows: those sampled, none padding
            logits = (self.model.compute_logits(hidden[0, logit_rows])
                      if self.is_driver and self.pooling is None else None)
        return hidden, logits

    def _pool(self, hidden: torch.Tensor, num_scheduled: np.ndarray) -> ModelRunnerOutput:
        return self.pooling.pool(hidden, self.input_batch, num_scheduled, self.forward_context())

    def forward_context(self, **fields) -> ForwardContext:
        """The context of a forward of this engine (``fields``: the forward's
        own, e.g. its attention layout): its kernels, and its compile cache
        while it may still compile (before warmup finished, or without it)."""
        stats = self.compile_stats
        compiling = stats.cache_dir is not None and not stats.warmed_up
        return ForwardContext(kernels=self.kernels,
                              compile_cache_dir=stats.cache_dir if compiling else None,
                              **fields)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None
                      ) -> ModelRunnerOutput | InFlightOutput:
        if self.pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        pending, self.pending = self.pending, None
        return sample_step(self, pending, grammar_output)

    def reset_encoder_cache(self) -> None:
        if self.images is not None:
            self.images.cache.clear()

    def supported_tasks(self) -> tuple[str, ...]:
        return self.pooling.supported_tasks() if self.pooling is not None else ("generate",)

    def _plan_forwards(self, num_tokens: int) -> list[int]:
        return plan_forwards(num_tokens, self.token_buckets, self.forward_costs)

    def _context_bucket(self, blocks: int) -> int:
        return fit_bucket(self.context_buckets, blocks, "context blocks",
                          env_var_name("context_buckets"))

