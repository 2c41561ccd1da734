"""A torchvision-free stand-in for transformers' ``Qwen2VLVideoProcessor``,
and its registration (patch 2 in ``vllm_accel/patches.py``, which says why).

Same name, class defaults and init kwargs as the real class, so
``from_pretrained`` and attribute reads work, but processing a video raises
ImportError. patches.py imports this module only when it registers the
stand-in (without torchvision): importing it imports transformers'
processing modules.

The classes are defined at module level, so instances pickle by reference to
this module (``vllm_accel.video_stub.Qwen2VLVideoProcessor``) and unpickle in
any process that can import it.
"""

from __future__ import annotations

import importlib

import transformers
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.processing_utils import VideosKwargs
from transformers.video_processing_utils import VideoProcessorMixin


class Qwen2VLVideoProcessorInitKwargs(VideosKwargs, total=False):
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int


class Qwen2VLVideoProcessor(VideoProcessorMixin):
    resample = PILImageResampling.BICUBIC
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_resize = True
    do_rescale = True
    do_normalize = True
    do_convert_rgb = True
    patch_size = 14
    temporal_patch_size = 2
    merge_size = 2
    min_frames = 4
    max_frames = 768
    do_sample_frames = False
    valid_kwargs = Qwen2VLVideoProcessorInitKwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, **kwargs):
        # As the real class: min/max_pixels override size.
        size = kwargs.pop("size", None)
        size = dict(self.size) if size is None else dict(size)
        if kwargs.get("min_pixels") is not None:
            size["shortest_edge"] = kwargs["min_pixels"]
        if kwargs.get("max_pixels") is not None:
            size["longest_edge"] = kwargs["max_pixels"]
        super().__init__(size=size, **kwargs)

    def preprocess(self, videos, **kwargs):
        raise ImportError(
            "Qwen2VLVideoProcessor is a vllm-accel stand-in (torchvision is not "
            "installed): video inputs are not supported; images are."
        )


class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """The stand-in for Qwen3-VL's video processor: its class defaults
    (16-pixel patches, ImageNet's 0.5 mean and std, 2 fps), video refused the same way."""

    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
    image_mean = [0.5, 0.5, 0.5]
    image_std = [0.5, 0.5, 0.5]
    patch_size = 16
    do_sample_frames = True
    fps = 2


# (config module, config class, stand-in) for each Qwen video processor.
QWEN_VIDEO_CONFIGS = (
    ("transformers.models.qwen2_vl.configuration_qwen2_vl", "Qwen2VLConfig",
     Qwen2VLVideoProcessor),
    ("transformers.models.qwen2_5_vl.configuration_qwen2_5_vl", "Qwen2_5_VLConfig",
     Qwen2VLVideoProcessor),
    ("transformers.models.qwen3_vl.configuration_qwen3_vl", "Qwen3VLConfig",
     Qwen3VLVideoProcessor),
)


def register() -> None:
    """Make ``AutoVideoProcessor`` give the stand-ins for Qwen2-VL, Qwen2.5-VL
    and Qwen3-VL configs, and ``ProcessorMixin`` accept them."""
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor

    # ProcessorMixin checks a video_processor argument against
    # transformers.VideoProcessorMixin, which transformers only exports
    # with torchvision; failing that it searches
    # transformers.VIDEO_PROCESSOR_MAPPING, a dummy without torchvision,
    # and raises AttributeError. Export the (torchvision-free) base class.
    if "VideoProcessorMixin" not in vars(transformers):
        transformers.VideoProcessorMixin = VideoProcessorMixin

    for module_name, class_name, stand_in in QWEN_VIDEO_CONFIGS:
        config_class = getattr(importlib.import_module(module_name), class_name)
        AutoVideoProcessor.register(
            config_class, video_processor_classes={"torchvision": stand_in}, exist_ok=True,
        )
