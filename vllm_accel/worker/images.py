"""A step's images: encoded when vLLM schedules them (prefill only), each
once, kept by identifier until vLLM frees them, and merged into the text
embeddings at their placeholder positions.

Under tensor parallelism every rank holds the whole vision side; each image
is encoded on one rank (the ranks take turns, image by image, so a step's
images encode in parallel) and broadcast to the others, which know its size
from its placeholder. Every rank sees the same schedules, so all agree on
whose turn it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_accel.multimodal.encoder import VisionEncoder, merge_embeddings
from vllm_accel.multimodal.inputs import item_tensors
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.worker.request_state import RequestStates
from vllm_accel.worker.multimodal_rows import placeholder_rows
from vllm_accel.worker.step_layout import BucketedForward, StepLayout


@dataclass
class MultimodalRows:
    """A step's image rows in packed order."""

    is_mm: np.ndarray  # [tokens] bool: the packed token takes an image row
    before: np.ndarray  # [tokens + 1]: image rows before each packed token
    rows: torch.Tensor | None  # [image rows, hidden]


class StepImages:
    def __init__(self, vision: VisionAdapter, encoder: VisionEncoder, tp_size: int,
                 device: torch.device, dtype: torch.dtype, hidden_size: int):
        self.vision = vision
        self.encoder = encoder
        self.tp_size = tp_size
        self.device, self.dtype = device, dtype
        self.row_width = vision.embedding_width(hidden_size)  # an encoded image's rows
        self.cache: dict[str, torch.Tensor] = {}  # image identifier -> embeddings
        self.images_scheduled = 0  # new images so far: whose turn to encode (TP)

    def encode_scheduled(self, scheduler_output: SchedulerOutput,
                         requests: RequestStates) -> None:
        """Encode the images whose placeholders this step reaches, each once:
        vLLM schedules an image again only after freeing it."""
        for image_id in scheduler_output.free_encoder_mm_hashes:
            self.cache.pop(image_id, None)
        features = {}  # identifier -> feature, each new image once, in schedule order
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = requests[req_id].mm_features[index]
                if feature.identifier not in self.cache:
                    features.setdefault(feature.identifier, feature)
        if not features:
            return
        if self.tp_size == 1:
            items = [item_tensors(f.data) for f in features.values()]
            self.cache.update(zip(features, self.encoder.encode(items)))
            return
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        rank, size = group.rank_in_group, group.world_size
        owners = [(self.images_scheduled + i) % size for i in range(len(features))]
        self.images_scheduled += len(features)
        mine = iter(self.encoder.encode(
            [item_tensors(f.data) for f, owner in zip(features.values(), owners) if owner == rank]))
        for feature, owner in zip(features.values(), owners):
            if owner == rank:
                embeds = next(mine).to(self.device, self.dtype).contiguous()
            else:
                embeds = torch.empty((feature.mm_position.get_num_embeds(), self.row_width),
                                     dtype=self.dtype, device=self.device)
            self.cache[feature.identifier] = group.broadcast(embeds, src=owner)

    def rows(self, step: StepLayout, requests: RequestStates) -> MultimodalRows:
        """Which of the step's packed tokens take image rows, and those rows
        (see multimodal_rows.placeholder_rows)."""
        placeholders = [s.placeholders for s in requests.in_batch_order()]
        is_mm, slices = placeholder_rows(step, placeholders)
        rows = (torch.cat([self.cache[key][lo:hi] for key, lo, hi in slices])
                if slices else None)
        return MultimodalRows(is_mm, np.concatenate([[0], np.cumsum(is_mm)]), rows)

    def embeddings(self, forward: BucketedForward, input_ids: torch.Tensor,
                   multimodal: MultimodalRows) -> torch.Tensor:
        """The forward's text embeddings with image rows at its placeholder
        positions."""
        embeds = self.vision.embed_tokens(input_ids)
        first, last = multimodal.before[forward.begin], multimodal.before[forward.end]
        if first == last:
            return embeds
        is_mm = np.zeros(forward.bucket, dtype=bool)
        is_mm[: forward.end - forward.begin] = multimodal.is_mm[forward.begin : forward.end]
        return merge_embeddings(embeds, multimodal.rows[first:last], torch.from_numpy(is_mm))

    def sizes(self) -> dict[str, int]:
        return {"encoder_cache_entries": len(self.cache),
                "encoder_cache_rows": sum(int(t.shape[0]) for t in self.cache.values())}
