"""One backend's side of benchmarks/embedding.py: embed a batch of mixed-length
sentences, print one JSON line (sentences/s over a timed run of at least
--min-seconds, after one untimed batch). Runs inside the backend's own Python.
--profile: one batch under torch's profiler instead (the GPU's kernels by
time; vLLM's engine core in this process so that the profiler sees it)."""
import argparse
import json
import random
import sys
import time


def sentences(vocab: int, count: int, shortest: int, longest: int, seed: int):
    """Random token ids (none of the first few: specials and RoBERTa's pad),
    lengths uniform in [shortest, longest]: identical on every backend."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(shortest, longest))]
            for _ in range(count)]


def profile(encode, batch) -> None:
    """One batch under torch's profiler: wall time, GPU busy time, top kernels."""
    import torch
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        encode(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"profile: one batch {wall * 1e3:.1f} ms wall, GPU kernels {busy / 1e3:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sentences", type=int, default=1024)
    p.add_argument("--shortest", type=int, default=8)
    p.add_argument("--longest", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--min-seconds", type=float, default=10.0)
    p.add_argument("--hf", action="store_true", help="HF's class on the GPU instead of vLLM")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    if a.profile:
        import os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    if a.hf:
        return run_hf(a)
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=512, seed=0,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              enforce_eager=a.enforce_eager)
    load_s = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def batch(number):
        return [TokensPrompt(prompt_token_ids=ids) for ids in
                sentences(vocab, a.sentences, a.shortest, a.longest, number)]

    llm.embed(batch(0), use_tqdm=False)  # untimed
    if a.profile:
        return profile(lambda prompts: llm.embed(prompts, use_tqdm=False), batch(1))
    done = tokens = 0
    elapsed = 0.0
    number = 1
    while done == 0 or elapsed < a.min_seconds:
        prompts = batch(number)
        t0 = time.perf_counter()
        outs = llm.embed(prompts, use_tqdm=False)
        elapsed += time.perf_counter() - t0
        assert len(outs) == len(prompts)
        done += len(prompts)
        tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        number += 1
    print(json.dumps(dict(vllm=vllm.__version__, torch=torch.__version__, python=sys.executable,
                          dtype=a.dtype, load_s=round(load_s, 2), elapsed_s=round(elapsed, 3),
                          sentences=done, sentences_s=round(done / elapsed, 1),
                          tokens_s=round(tokens / elapsed, 1),
                          dimensions=len(outs[0].outputs.embedding))), flush=True)


def run_hf(a):
    """sentence-transformers' encode with HF's class: sentences sorted by
    length, batches of 32 padded to their longest, CLS pooled, normalized."""
    import torch
    import transformers
    from transformers import AutoModel

    t0 = time.perf_counter()
    model = AutoModel.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).cuda().eval()
    load_s = time.perf_counter() - t0
    pad = model.config.pad_token_id

    def encode(batch):
        order = sorted(range(len(batch)), key=lambda i: -len(batch[i]))
        out = [None] * len(batch)
        with torch.inference_mode():
            for start in range(0, len(order), 32):
                rows = order[start:start + 32]
                longest = len(batch[rows[0]])
                ids = torch.full((len(rows), longest), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), longest), dtype=torch.long)
                for r, i in enumerate(rows):
                    ids[r, :len(batch[i])] = torch.tensor(batch[i])
                    mask[r, :len(batch[i])] = 1
                hidden = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).last_hidden_state
                vectors = torch.nn.functional.normalize(hidden[:, 0].float(), dim=-1).cpu()
                for r, i in enumerate(rows):
                    out[i] = vectors[r]
        return out

    vocab = model.config.vocab_size
    encode(sentences(vocab, a.sentences, a.shortest, a.longest, 0))  # untimed
    if a.profile:
        return profile(encode, sentences(vocab, a.sentences, a.shortest, a.longest, 1))
    done = tokens = 0
    elapsed = 0.0
    number = 1
    while done == 0 or elapsed < a.min_seconds:
        batch = sentences(vocab, a.sentences, a.shortest, a.longest, number)
        t0 = time.perf_counter()
        outs = encode(batch)
        elapsed += time.perf_counter() - t0
        done += len(outs)
        tokens += sum(map(len, batch))
        number += 1
    print(json.dumps(dict(transformers=transformers.__version__, torch=torch.__version__,
                          python=sys.executable, dtype=a.dtype, load_s=round(load_s, 2),
                          elapsed_s=round(elapsed, 3), sentences=done,
                          sentences_s=round(done / elapsed, 1), tokens_s=round(tokens / elapsed, 1),
                          dimensions=len(outs[0]))), flush=True)


if __name__ == "__main__":
    main()
