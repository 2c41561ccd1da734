"""MolmoImageProcessor for the tiny offline Molmo fixture (trust_remote_code).

Written for vllm-accel's tests: numpy + PIL only (the hub's version needs
torchvision), same settings and outputs as the hub's Molmo image processor.

Molmo's "overlap-and-resize" cropping, per image:

* Pick a tiling (rows x cols) of crop *windows* (a crop minus its overlap
  margins) that fits the image with the least up-scaling (or, if it must
  shrink, the least down-scaling), among tilings of at most ``max_crops``.
* Resize the image (aspect ratio kept, centred, zero-padded) to exactly
  that tiling plus one margin on each side, and cut overlapping crops of
  ``base_image_input_size`` with a stride of one window.
* Each crop becomes a grid of patches that the model pools 2x2. Only the
  pooled cells of a crop's window (and the image border margins) become
  tokens, so neighbouring crops' features do not repeat.
* A "global" crop, the whole image resized to one crop, goes first.

Tokens for one image: ``<im_start> (<im_patch>*tw <im_col>)*th <im_end>`` for
the global crop, then ``<im_start> (<im_patch>*cols' <im_col>)*rows' <im_end>``
for the pooled grid of the tiled image. ``image_input_idx[crop, cell]`` is the
position in the token sequence of the pooled cell's ``<im_patch>`` (negative:
cell not used), so feature order = order of ``<im_patch>`` tokens.
"""

from typing import List, Optional

import numpy as np
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

UNUSED_CELL = -100  # image_input_idx value of a pooled cell with no token
POOL = 2  # the model pools 2x2 patches into one token


def candidate_tilings(max_crops: int) -> list:
    """(rows, cols) with rows * cols <= max_crops; fewer crops first, then
    fewer rows (argmin/argmax below keep the first of equals)."""
    tilings = [(r, c) for r in range(1, max_crops + 1) for c in range(1, max_crops + 1)
               if r * c <= max_crops]
    return sorted(tilings, key=lambda t: (t[0] * t[1], t[0]))


def select_tiling(height: float, width: float, window: int, max_crops: int):
    """The tiling whose window grid needs the least up-scaling of the image,
    or, if every tiling needs down-scaling, the least down-scaling."""
    tilings = np.array(candidate_tilings(max_crops), dtype=np.int32)
    sizes = (tilings * window).astype(np.float32)
    scale = (sizes / np.array([height, width], dtype=np.float32)).min(axis=-1)
    if (scale < 1).all():
        ix = int(np.argmax(scale))
    else:
        ix = int(np.argmin(np.where(scale < 1.0, 10e9, scale)))
    return int(tilings[ix][0]), int(tilings[ix][1])


def resize_and_pad(image: np.ndarray, out_h: int, out_w: int):
    """uint8 HxWx3 -> (float32 out_h x out_w x 3 in [0, 1], bool mask of real
    pixels): bilinear with antialiasing (PIL, as torchvision's antialiased
    resize), aspect ratio kept, centred, zero padding."""
    height, width = image.shape[:2]
    scale = min(np.float32(out_h) / np.float32(height), np.float32(out_w) / np.float32(width))
    new_h = max(1, int(np.float32(height) * scale))
    new_w = max(1, int(np.float32(width) * scale))
    src = image.astype(np.float32) / 255.0
    channels = [
        np.asarray(Image.fromarray(np.ascontiguousarray(src[:, :, c]))
                   .resize((new_w, new_h), Image.BILINEAR))
        for c in range(src.shape[2])
    ]
    resized = np.clip(np.stack(channels, axis=-1), 0.0, 1.0)
    top, left = (out_h - new_h) // 2, (out_w - new_w) // 2
    pad = [(top, out_h - new_h - top), (left, out_w - new_w - left)]
    mask = np.pad(np.ones((new_h, new_w), dtype=bool), pad)
    return np.pad(resized, pad + [(0, 0)]), mask


def to_patches(crop: np.ndarray, patch: int) -> np.ndarray:
    """H x W x C -> (H/p * W/p) x (p * p * C), patches row-major, pixels
    (dy, dx, channel) within a patch."""
    h, w = crop.shape[0] // patch, crop.shape[1] // patch
    x = crop.reshape(h, patch, w, patch, *crop.shape[2:])
    x = np.moveaxis(x, 2, 1)  # h, w, dy, dx, [c]
    return x.reshape(h * w, -1)


def window_cells(n_tiles: int, crop_patches: int, margins) -> list:
    """Per tile along one axis: (first used pooled cell in the crop, number of
    used pooled cells). A crop keeps its window plus the image-border margins."""
    left, right = margins
    window = crop_patches - left - right
    cells = []
    for i in range(n_tiles):
        used = window + (left if i == 0 else 0) + (right if i == n_tiles - 1 else 0)
        cells.append((0 if i == 0 else left // POOL, (used + POOL - 1) // POOL))
    return cells


class MolmoImageProcessor(BaseImageProcessor):
    """Crops, pixel patches, token layout and pooled-cell positions per image."""

    model_input_names = ["images", "image_input_idx", "image_masks"]

    def __init__(
        self,
        max_crops: int = 12,
        overlap_margins: List[int] = (4, 4),
        base_image_input_size: List[int] = (336, 336),
        image_token_length_w: int = 12,
        image_token_length_h: int = 12,
        image_patch_size: int = 14,
        image_padding_mask: bool = True,
        do_normalize: bool = True,
        image_mean: Optional[List[float]] = None,
        image_std: Optional[List[float]] = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.max_crops = max_crops
        self.overlap_margins = list(overlap_margins)
        self.base_image_input_size = list(base_image_input_size)
        self.image_token_length_w = image_token_length_w
        self.image_token_length_h = image_token_length_h
        self.image_patch_size = image_patch_size
        self.image_padding_mask = image_padding_mask
        self.do_normalize = do_normalize
        self.image_mean = list(image_mean or OPENAI_CLIP_MEAN)
        self.image_std = list(image_std or OPENAI_CLIP_STD)

    def _normalize(self, image: np.ndarray) -> np.ndarray:
        if not self.do_normalize:
            return image
        mean = np.array(self.image_mean, dtype=np.float32)
        std = np.array(self.image_std, dtype=np.float32)
        return ((image - mean) / std).astype(np.float32)

    def preprocess(self, image, image_patch_token_id, image_col_token_id,
                   image_start_token_id, image_end_token_id, max_crops=None,
                   overlap_margins=None, base_image_input_size=None,
                   image_token_length_w=None, image_token_length_h=None,
                   image_patch_size=None, **kwargs):
        """One uint8 HxWx3 image -> (crops [n, patches, p*p*3], tokens [t],
        image_input_idx [n, th*tw] (positions in ``tokens``), masks [n, patches])."""
        max_crops = max_crops or self.max_crops
        margins = list(overlap_margins or self.overlap_margins)
        base = base_image_input_size or self.base_image_input_size
        base_h, base_w = (base, base) if isinstance(base, int) else base
        tw = image_token_length_w or self.image_token_length_w
        th = image_token_length_h or self.image_token_length_h
        patch = image_patch_size or self.image_patch_size
        if margins[0] % POOL:
            raise ValueError("the left overlap margin must be even (2x2 pooling)")
        crop_patches = base_h // patch
        if (crop_patches + 1) // POOL != th or (base_w // patch + 1) // POOL != tw:
            raise ValueError("image_token_length_w/h must be the pooled crop size")

        margin_px = patch * sum(margins)
        window_px = (crop_patches - sum(margins)) * patch
        rows, cols = select_tiling(image.shape[0] - margin_px, image.shape[1] - margin_px,
                                   window_px, max_crops)
        src, real = resize_and_pad(image, rows * window_px + margin_px,
                                   cols * window_px + margin_px)
        src = self._normalize(src)

        row_cells = window_cells(rows, crop_patches, margins)
        col_cells = window_cells(cols, crop_patches, margins)
        grid_h = sum(n for _, n in row_cells)
        grid_w = sum(n for _, n in col_cells)

        global_tokens = [image_start_token_id] + ([image_patch_token_id] * tw
                                                  + [image_col_token_id]) * th
        global_tokens.append(image_end_token_id)
        joint_start = len(global_tokens) + 1  # first <im_patch> of the tiled grid
        tokens = global_tokens + [image_start_token_id] + (
            [image_patch_token_id] * grid_w + [image_col_token_id]) * grid_h
        tokens.append(image_end_token_id)

        # Global crop first: its cell (r, c) is token 1 + r * (tw + 1) + c.
        cell_r, cell_c = np.meshgrid(np.arange(th), np.arange(tw), indexing="ij")
        index = [(1 + cell_r * (tw + 1) + cell_c).reshape(-1)]
        crops = [to_patches(self._normalize(resize_and_pad(image, base_h, base_w)[0]), patch)]
        masks = []
        grid_row = 0
        for i, (r0, nr) in enumerate(row_cells):
            grid_col = 0
            for j, (c0, nc) in enumerate(col_cells):
                y0, x0 = i * window_px, j * window_px
                crops.append(to_patches(src[y0:y0 + base_h, x0:x0 + base_w], patch))
                masks.append(to_patches(real[y0:y0 + base_h, x0:x0 + base_w], patch)
                             .astype(np.float32).mean(axis=-1))
                used = ((cell_r >= r0) & (cell_r < r0 + nr) & (cell_c >= c0) & (cell_c < c0 + nc))
                pos = (joint_start + (grid_row + cell_r - r0) * (grid_w + 1)
                       + grid_col + cell_c - c0)
                index.append(np.where(used, pos, UNUSED_CELL).reshape(-1))
                grid_col += nc
            grid_row += nr
        # As the hub's Molmo preprocessing does (kept for fidelity to released
        # checkpoints): the masks list the tiles only, then one row of -1, so
        # mask row k belongs to tile k, not to crop k (crop 0 is global).
        masks.append(np.full_like(masks[0], -1.0))
        return (np.stack(crops).astype(np.float32), np.array(tokens, dtype=np.int64),
                np.stack(index).astype(np.int64), np.stack(masks).astype(np.float32))

    def multimodal_preprocess(self, images, tokens, image_patch_token_id, image_col_token_id,
                              image_start_token_id, image_end_token_id, image_padding_mask=None,
                              **kwargs):
        """Images (all inserted before the text, as Molmo does) + text tokens ->
        input_ids, images, image_input_idx (positions in input_ids), image_masks."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not images:
            return {"input_ids": tokens}
        if image_padding_mask is None:
            image_padding_mask = self.image_padding_mask
        pieces, crops, index, masks = [], [], [], []
        offset = 0
        for image in images:
            c, t, idx, m = self.preprocess(image, image_patch_token_id, image_col_token_id,
                                           image_start_token_id, image_end_token_id, **kwargs)
            crops.append(c)
            index.append(np.where(idx >= 0, idx + offset, idx))
            masks.append(m)
            pieces.append(t)
            offset += len(t)
        out = {
            "input_ids": np.concatenate(pieces + [tokens]),
            "images": np.concatenate(crops),
            "image_input_idx": np.concatenate(index),
        }
        if image_padding_mask:
            out["image_masks"] = np.concatenate(masks)
        return out


MolmoImageProcessor.register_for_auto_class()
