"""MolmoProcessor for the tiny offline Molmo fixture (trust_remote_code).

Written for vllm-accel's tests, torchvision-free, with the interface of the
hub's Molmo processor that vLLM's Molmo processing calls:
``process(text, images, *, tokens=None, ...)`` -> ``input_ids`` (bos first),
``images``, ``image_input_idx``, ``image_masks``; ``get_tokens_input``; and the
image tokens ``<im_start> <im_end> <im_patch> <im_col> <|image|>``.
"""

import numpy as np
from PIL import Image, ImageOps
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

IMAGE_PATCH_TOKEN = "<im_patch>"
IM_START_TOKEN = "<im_start>"
IM_END_TOKEN = "<im_end>"
IM_COL_TOKEN = "<im_col>"
IMAGE_PROMPT = "<|image|>"
EXTRA_TOKENS = (IM_START_TOKEN, IM_END_TOKEN, IMAGE_PATCH_TOKEN, IM_COL_TOKEN, IMAGE_PROMPT)

# Image settings a caller may override per call (None: the image processor's).
_IMAGE_KWARGS = ("max_crops", "overlap_margins", "base_image_input_size",
                 "image_token_length_w", "image_token_length_h", "image_patch_size",
                 "image_padding_mask")


def _as_rgb_array(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        # EXIF orientation first, as the hub's processor does.
        return np.array(ImageOps.exif_transpose(image.convert("RGB")))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError("Molmo images must be PIL images or H x W x 3 arrays")
    return array.astype(np.uint8)


class MolmoProcessor(ProcessorMixin):
    """Text + images -> Molmo model inputs (images are placed before the text)."""

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)
        self._special_token_ids = None

    @property
    def special_token_ids(self) -> dict:
        if self._special_token_ids is None:
            ids = self.tokenizer.encode("".join(EXTRA_TOKENS), add_special_tokens=False)
            if len(ids) != len(EXTRA_TOKENS):
                raise ValueError("the tokenizer lacks Molmo's image tokens")
            self._special_token_ids = dict(zip(EXTRA_TOKENS, ids))
        return self._special_token_ids

    def get_tokens_input(self, prompt, message_format, always_start_with_space):
        """Prompt text -> token ids, with Molmo's "User: ... Assistant:" framing
        for message_format "role" and an optional leading space."""
        prompt = "" if prompt is None else prompt
        if message_format == "role":
            prompt = "User: " + prompt + " Assistant:"
        elif message_format not in ("none", None):
            raise NotImplementedError(f"message format {message_format!r}")
        if always_start_with_space:
            prompt = " " + prompt
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def process(self, text=None, images=None, *, tokens=None, message_format="role",
                always_start_with_space=True, return_tensors="pt", max_crops=None,
                overlap_margins=None, base_image_input_size=None, image_token_length_w=None,
                image_token_length_h=None, image_patch_size=None, image_padding_mask=None,
                **kwargs):
        """``tokens`` (already tokenized text) replaces ``text``. The bos (or,
        as for Qwen2/OLMo tokenizers without one, the eos) goes first."""
        if tokens is None:
            tokens = self.get_tokens_input(text, message_format, always_start_with_space)
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        given = dict(zip(_IMAGE_KWARGS, (max_crops, overlap_margins, base_image_input_size,
                                         image_token_length_w, image_token_length_h,
                                         image_patch_size, image_padding_mask)))
        image_kwargs = {k: v for k, v in given.items() if v is not None}
        special = self.special_token_ids
        out = self.image_processor.multimodal_preprocess(
            images=[_as_rgb_array(im) for im in images] if images else None,
            tokens=np.asarray(tokens, dtype=np.int64),
            image_patch_token_id=special[IMAGE_PATCH_TOKEN],
            image_col_token_id=special[IM_COL_TOKEN],
            image_start_token_id=special[IM_START_TOKEN],
            image_end_token_id=special[IM_END_TOKEN],
            **image_kwargs,
        )
        bos = self.tokenizer.bos_token_id
        if bos is None:
            bos = self.tokenizer.eos_token_id
        out["input_ids"] = np.concatenate([[bos], out["input_ids"]]).astype(np.int64)
        if "image_input_idx" in out:  # every position moved by one
            idx = out["image_input_idx"]
            out["image_input_idx"] = np.where(idx >= 0, idx + 1, idx)
        return BatchFeature(out, tensor_type=return_tensors)


MolmoProcessor.register_for_auto_class()
