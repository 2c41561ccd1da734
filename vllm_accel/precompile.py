"""Fill a compile cache directory ahead of time, for a deployment to ship.

    python -m vllm_accel.precompile MODEL --compile-cache-dir DIR [vllm serve options]

starts the engine once with vLLM's own engine arguments (the same options as
``vllm serve``), which compiles every bucket into DIR, then exits. A server
started with ``VLLM_ACCEL_COMPILE_CACHE_DIR=DIR`` and the same options (model,
buckets, KV cache size, max_model_len, tensor parallel size: they fix the
graphs' shapes) then loads every graph from DIR instead of compiling it, as
vllm-gaudi's and vllm-spyre's shipped compile caches do.
"""

from __future__ import annotations

import os
import time

from vllm_accel.log import get_logger

logger = get_logger(__name__)


def main(argv: list[str] | None = None) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m vllm_accel.precompile",
                                    description=__doc__.split("\n")[0])
    parser.add_argument("model_tag", metavar="MODEL", help="model directory or name")
    parser.add_argument("--compile-cache-dir", required=True,
                        help="directory the compiled graphs are written to")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    args.model = args.model_tag
    # The setting's environment variable: read by the engine's own processes too.
    os.environ["VLLM_ACCEL_COMPILE_CACHE_DIR"] = os.path.abspath(args.compile_cache_dir)
    os.environ.setdefault("VLLM_PLUGINS", "accel")

    from vllm.v1.engine.llm_engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    del engine
    logger.info(
        "vllm_accel precompile: %s compiled into %s in %.1f s; serve with "
        "VLLM_ACCEL_COMPILE_CACHE_DIR=%s and the same options to start from it.",
        args.model, os.environ["VLLM_ACCEL_COMPILE_CACHE_DIR"], time.perf_counter() - started,
        os.environ["VLLM_ACCEL_COMPILE_CACHE_DIR"],
    )


if __name__ == "__main__":
    main()
