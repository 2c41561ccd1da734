"""Vision-language support: ``mm_mappings`` (one util per architecture, on the
contract in ``mm_mappings/base.py``), the bucketed vision encoder every
architecture shares (``encoder.py``), and vLLM input parsing plus warmup
images (``inputs.py``)."""
