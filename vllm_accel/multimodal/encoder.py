"""The vision machinery every architecture shares: static-shape padding and
compilation of the encoder, encoding with a count, and merging image rows
into the text embeddings. What differs per architecture comes from its
``VisionAdapter`` (mm_mappings)."""

from __future__ import annotations

import torch

from vllm_accel.buckets import find_bucket, fit_bucket, make_buckets
from vllm_accel.compat import map_tensors
from vllm_accel.model.compile import BucketAxis, compile_shared_forward
from vllm_accel.forward_context import get_forward_context, set_forward_context
from vllm_accel.model.saved_graphs import SavedGraphs
from vllm_accel.multimodal.mm_mappings.base import VisionAdapter
from vllm_accel.settings import env_var_name


def pack_first_fit(rows: list[int], budget: int) -> list[list[int]]:
    """Indices of images grouped so that a group's rows stay within ``budget``:
    each image, in order, joins the first group it fits in, else starts one
    (an image over the budget is alone in its group)."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for index, count in enumerate(rows):
        fits = [g for g, total in enumerate(totals) if total + count <= budget]
        if fits:
            groups[fits[0]].append(index)
            totals[fits[0]] += count
        else:
            groups.append([index])
            totals.append(count)
    return groups


def pack_least_padding(rows: list[int], buckets: list[int], budget: int) -> list[list[int]]:
    """``pack_first_fit`` under the budget, among ``budget`` and the smaller
    buckets that hold the largest image, whose calls pad to the fewest rows in
    all (ties: fewer calls). Images of a step can come a few at a time: three
    576-patch images fill 1,728 of a 2,048-row bucket, or pad to 3 x 1,024."""
    def padded(total: int) -> int:
        return find_bucket(buckets, total) or total

    largest = max(rows, default=0)
    budgets = [b for b in buckets if largest <= b < budget] + [budget]
    best: tuple[tuple[int, int], list[list[int]]] | None = None
    for limit in budgets:
        groups = pack_first_fit(rows, limit)
        cost = (sum(padded(sum(rows[i] for i in g)) for g in groups), len(groups))
        if best is None or cost < best[0]:
            best = (cost, groups)
    return best[1]


class VisionEncoder:
    """Encodes images with an architecture's util, several per call.

    The images of a step are packed (first fit) into calls of at most
    ``batch_rows`` rows (the adapter's ``vision_batch_rows``) or of a smaller
    bucket, whichever pads least, like vLLM's encoder token budgets: fewer,
    larger calls. Compiled, the util's
    ``vision_module`` sees its first input's leading axis zero-padded to the
    smallest vision bucket that fits (one graph per bucket, or one for all
    of them; outputs sliced back to the real rows): its forward is wrapped by
    ``_padded_forward``.
    """

    def __init__(self, adapter: VisionAdapter, compile_backend: str | None = None,
                 bucket_spec: str = "", saved: SavedGraphs | None = None,
                 shared_graphs: bool = False):
        """``bucket_spec``: the multimodal_buckets setting ("" = the util's own
        buckets, whose smallest and largest also fill in a range spec);
        ``shared_graphs``: one graph for the buckets above 1, where the adapter
        names the axis they pad (settings.bucket_graphs)."""
        self.adapter = adapter
        derived = adapter.vision_buckets()
        buckets = make_buckets(bucket_spec, derived[0], derived[-1]) if bucket_spec else derived
        multiple = adapter.vision_bucket_multiple
        self.image_buckets = sorted({-(-b // multiple) * multiple for b in buckets})
        budget = adapter.vision_batch_rows(self.image_buckets)
        self.buckets = list(self.image_buckets)
        if not bucket_spec:
            # Packed calls may outgrow the largest image: doublings of it up
            # to the adapter's budget (else several small images pad each to
            # a bucket of its own, e.g. 576-patch images to 1024 one by one).
            while self.buckets[-1] * 2 <= budget:
                self.buckets.append(self.buckets[-1] * 2)
        self.batch_rows = max([b for b in self.buckets if b <= budget], default=self.buckets[0])
        self.images_encoded = 0
        self.calls = 0  # vision module calls: images_encoded / calls per call
        if compile_backend is not None:
            axis = (BucketAxis(adapter.vision_bucket_axis, self.buckets[-1])
                    if shared_graphs and adapter.vision_bucket_axis else None)
            compile_shared_forward(adapter.vision_compile_units(), compile_backend,
                                   len(self.buckets) * adapter.vision_graphs_per_bucket, saved,
                                   axis)
            module = adapter.vision_module
            # An instance attribute wins over the class's forward in nn.Module.__call__.
            module.forward = self._padded_forward(module.forward)

    @torch.inference_mode()
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per image: its embeddings [num_embeds, hidden], in item order."""
        rows = [self.adapter.vision_rows(item) for item in items]
        outputs: list[torch.Tensor | None] = [None] * len(items)
        for group in pack_least_padding(rows, self.buckets, self.batch_rows):
            for index, embeds in zip(group, self.adapter.encode_items([items[i] for i in group])):
                outputs[index] = embeds
            self.images_encoded += len(group)
            self.calls += 1
        return outputs

    def warmup_groups(self, items: list[dict[str, torch.Tensor]]) -> list[list[dict]]:
        """Calls that compile every bucket: each of ``items`` (one image per
        image bucket, smallest first) alone, then for each packing bucket as
        many copies of the largest as fit (more rows than the bucket below)."""
        groups = [[item] for item in items]
        largest = items[-1]
        rows = self.adapter.vision_rows(largest)
        for bucket in self.buckets[len(self.image_buckets):]:
            groups.append([largest] * (bucket // rows))
        return groups

    def _padded_forward(self, forward):
        """``forward`` (the vision module's) with its first inputs padded to a
        vision bucket and its outputs sliced back to the real rows."""
        def padded_forward(*args, **kwargs):
            count = self.adapter.vision_padded_args
            padded, rest = list(args[:count]), args[count:]
            rows = padded[0].shape[0]
            if len(padded) != count or any(t.shape[0] != rows for t in padded):
                raise ValueError(f"the vision module's first {count} inputs must share their "
                                 f"leading axis, got {[tuple(t.shape) for t in padded]}")
            bucket = fit_bucket(self.buckets, rows, "vision rows of one encoder call",
                                env_var_name("multimodal_buckets"))
            if bucket > rows:
                padded = [torch.cat([t, t.new_zeros(bucket - rows, *t.shape[1:])])
                          for t in padded]
            if self.adapter.vision_padding_rows_last:  # linears skip the padding rows
                with set_forward_context(get_forward_context().padded(bucket, rows)):
                    output = forward(*padded, *rest, **kwargs)
            else:
                output = forward(*padded, *rest, **kwargs)
            return map_tensors(lambda t: t[:rows], output)
        return padded_forward


def merge_embeddings(inputs_embeds: torch.Tensor, mm_embeds: torch.Tensor,
                     is_mm: torch.Tensor) -> torch.Tensor:
    """Text embeddings [1, T, hidden] with mm_embeds [N, hidden] at the N
    positions where is_mm [T] is set."""
    count = int(is_mm.sum())
    if count != mm_embeds.shape[0]:
        raise ValueError(f"{count} placeholder positions but {mm_embeds.shape[0]} "
                         "multimodal embeddings")
    merged = inputs_embeds.clone()
    merged[0, is_mm.to(merged.device)] = mm_embeds.to(merged.device, merged.dtype)
    return merged
