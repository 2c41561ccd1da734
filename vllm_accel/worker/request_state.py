"""Per-request state, mirrored from the scheduler into vLLM's ``InputBatch``.

``RequestState`` is vLLM's ``CachedRequestState`` (what ``InputBatch`` takes)
plus what our runner keeps per request. ``RequestStates.update`` applies one
``SchedulerOutput``: finished requests leave, new ones arrive, running ones
get their computed-token counts and new blocks. It is adapted from vLLM
0.33.0's ``GPUModelRunner._update_states`` (vllm/v1/worker/gpu_model_runner.py)
without speculative decoding and LoRA (async scheduling: only the
resumed requests' tokens; the rest is in_flight.py): diff against that
function when upgrading vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_accel.multimodal.inputs import item_tensors
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.worker.multimodal_rows import Placeholder, RopePositions
from vllm_accel.worker.pooling import PoolingHead


@dataclass
class RequestState(CachedRequestState):
    # Its images' prompt spans (vision-language models).
    placeholders: list[Placeholder] = field(default_factory=list)
    # 3-D rotary positions, for models that use them (M-RoPE).
    rope_positions: RopePositions | None = None
    # Top-k of the prompt logprobs it asked for, until its prompt is done.
    prompt_logprobs_pending: int | None = None


class RequestStates:
    def __init__(self, input_batch: InputBatch, device: torch.device,
                 vision: VisionAdapter | None = None, pooling: PoolingHead | None = None):
        self.batch = input_batch
        self.device = device
        self.vision = vision
        self.pooling = pooling  # a pooling model's pooler: it adjusts each request's parameters
        self.requests: dict[str, RequestState] = {}

    def __getitem__(self, req_id: str) -> RequestState:
        return self.requests[req_id]

    def in_batch_order(self) -> list[RequestState]:
        return [self.requests[req_id] for req_id in self.batch.req_ids]

    def update(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)

        # Requests not scheduled this step (preempted or waiting) leave the batch
        # but keep their state.
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        for req_id in set(batch.req_id_to_index) - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        to_add = [self._new_state(new) for new in scheduler_output.scheduled_new_reqs]
        for state in to_add:
            self.requests[state.req_id] = state

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
                num_outputs = cached.num_output_tokens[i]
                if req_id in cached.all_token_ids and num_outputs:
                    # The scheduler's copy: under async scheduling ours may
                    # hold placeholders for tokens that never reached us.
                    state.output_token_ids = cached.all_token_ids[req_id][-num_outputs:]
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = state.num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)

        for state in to_add:
            batch.add_request(state)
        batch.condense()
        batch.refresh_metadata()

    def _new_state(self, new) -> RequestState:
        params = new.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        state = RequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            prompt_embeds=new.prompt_embeds,
            prompt_is_token_ids=new.prompt_is_token_ids,
            mm_features=new.mm_features,
            sampling_params=params,
            pooling_params=new.pooling_params,
            generator=generator,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
            placeholders=[_placeholder(feature) for feature in new.mm_features],
        )
        if self.pooling is not None:
            self.pooling.prepare(new.pooling_params)
        if params is not None and params.prompt_logprobs is not None:
            # -1: the whole vocabulary.
            state.prompt_logprobs_pending = (self.batch.vocab_size if params.prompt_logprobs == -1
                                             else params.prompt_logprobs)
        if self.vision is not None and self.vision.uses_3d_positions:
            state.rope_positions = RopePositions(*self.vision.rope_positions(
                new.prompt_token_ids, [item_tensors(f.data) for f in new.mm_features]))
        return state

    def append_tokens(self, rows: list[int], tokens: list[int]) -> None:
        """Batch row ``rows[i]``'s new token ``tokens[i]`` onto its sequence."""
        if not rows:
            return
        batch = self.batch
        ends = batch.num_tokens_no_spec[rows]
        batch.token_ids_cpu[rows, ends] = tokens
        batch.is_token_ids[rows, ends] = True
        batch.num_tokens_no_spec[rows] = ends + 1
        req_ids = batch.req_ids
        for row, token in zip(rows, tokens):
            self[req_ids[row]].output_token_ids.append(token)

    def sizes(self) -> dict[str, int]:
        """How much state is held (a soak test checks it drains)."""
        states = self.requests.values()
        return {
            "requests": len(self.requests),
            "batch_requests": self.batch.num_reqs,
            "prompt_logprobs_pending": sum(s.prompt_logprobs_pending is not None for s in states),
            "rope_positions": sum(s.rope_positions is not None for s in states),
        }


def _placeholder(feature) -> Placeholder:
    """A vLLM ``MultiModalFeatureSpec``'s prompt span."""
    place = feature.mm_position
    is_embed = None if place.is_embed is None else place.is_embed.cpu().numpy().astype(bool)
    return Placeholder(feature.identifier, place.offset, place.length, is_embed)
