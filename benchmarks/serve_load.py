"""Soak/load test of `vllm serve` on vllm-accel.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_load.py --requests 500 --concurrency 32

Starts `vllm serve` on 127.0.0.1 (default: the tiny LlavaNext fixture, eager
compile backend, full warmup), sends a mixed load through the OpenAI API and
checks that the server comes back clean:

- load: text and image chats (1-2 images of varied sizes, some images shared
  between requests), short and long prompts, greedy and seeded sampling,
  streaming or not, n>1, logprobs, completions with prompt_logprobs; client
  disconnects mid-stream; abort storms (bursts cancelled almost at once); and
  deliberately bad requests (corrupt image, too many images, too-long prompt)
  that must each get a 4xx.
- after the load, once idle: vLLM's `vllm:kv_cache_usage_perc` is 0; the
  runner holds no request state and its encoder cache fits vLLM's encoder
  cache budget (read through vLLM's dev-mode `POST /collective_rpc` calling
  `AccelWorker.runner_state`); vLLM keeps finished requests' encoder outputs
  until it needs the space, so the cache is emptied by vLLM's dev-mode
  `POST /reset_encoder_cache` and must then be 0; no compile at run time (log
  lines and the runner's counter); the server still answers.

The last line is machine-parsable (`serve_load: requests=... alive=yes`); the
exit status is 1 if an invariant fails. Only loopback is used.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
from PIL import Image

from vllm_accel.testing.processes import end_process_group

VLLM = str(Path(sys.executable).with_name("vllm"))
RECOMPILE_LINE = "vllm_accel recompile at run time"
DRIFT_LINE = "P0/P1 cache drift"  # vLLM's warning for a MultiModalCacheMissError
WARMUP_LINE = re.compile(r"vllm_accel warmup finished in .*")
KV_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+(\S+)", re.M)
RUNNING = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\}\s+(\S+)", re.M)
IMAGE_SIZES = [(64, 64), (120, 80), (80, 200), (224, 224), (336, 200), (30, 300), (500, 360)]
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about "
         "rivers mountains and old stone bridges under a pale morning sky").split()


def log(msg: str) -> None:
    print(f"[serve_load] {msg}", flush=True)


# ---- the server ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: str, port: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_PLUGINS="accel", VLLM_SERVER_DEV_MODE="1",
               VLLM_ACCEL_COMPILE_BACKEND=args.compile_backend,
               VLLM_ACCEL_KVCACHE_SPACE=str(args.kv_space),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # serve as users do
    env.pop("VLLM_SKIP_WARMUP", None)  # warm up: nothing may compile while serving
    cmd = [VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(args.max_model_len),
           "--limit-mm-per-prompt", json.dumps({"image": args.max_images}),
           "--seed", str(args.seed)]
    log(f"starting: {' '.join(cmd)} (log: {log_path})")
    with open(log_path, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(proc: subprocess.Popen, base: str, log_path: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n"
                               f"{log_path.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve not ready in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    end_process_group(proc, time.time() + 30)


def tree_rss_mb(pid: int) -> float:
    """Resident memory of the server and all its descendants (engine core)."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


# ---- server-side state ----------------------------------------------------------

async def metric_values(http: httpx.AsyncClient, pattern: re.Pattern) -> list[float]:
    text = (await http.get("/metrics", timeout=10)).text
    return [float(v) for v in pattern.findall(text)]


async def wait_idle(http: httpx.AsyncClient, timeout: float) -> tuple[float, float]:
    """Poll /metrics until no request runs or waits and KV usage is 0 (or the
    timeout). Returns (kv_usage, running + waiting) as last seen."""
    deadline = time.time() + timeout
    while True:
        usage = max(await metric_values(http, KV_USAGE), default=float("nan"))
        busy = sum(await metric_values(http, RUNNING))
        if (usage == 0 and busy == 0) or time.time() > deadline:
            return usage, busy
        await asyncio.sleep(0.5)


async def runner_state(http: httpx.AsyncClient) -> dict:
    """AccelWorker.runner_state() through vLLM's dev-mode collective_rpc."""
    reply = await http.post("/collective_rpc", json={"method": "runner_state"}, timeout=30)
    reply.raise_for_status()
    return reply.json()["results"][0]


# ---- the workload ---------------------------------------------------------------

def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def noise_image(rng: random.Random) -> Image.Image:
    w, h = rng.choice(IMAGE_SIZES)
    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (h, w, 3), np.uint8)
    return Image.fromarray(pixels)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def bad_requests(model: str, max_images: int, max_model_len: int, good_url: str) -> list[dict]:
    """The deliberate 4xx cases: (kind, endpoint, body)."""
    png = base64.b64decode(good_url.split(",", 1)[1])
    corrupt = "data:image/png;base64," + base64.b64encode(png[:100]).decode()

    def chat(*parts):
        return {"model": model, "max_tokens": 4,
                "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                                   "text": "What is this?"}]}]}
    return [
        {"kind": "corrupt_image", "endpoint": "chat", "body": chat(image_part(corrupt))},
        {"kind": "too_many_images", "endpoint": "chat",
         "body": chat(*[image_part(good_url)] * (max_images + 1))},
        {"kind": "too_long_prompt", "endpoint": "completions",
         "body": {"model": model, "prompt": [7] * (max_model_len + 10), "max_tokens": 4}},
    ]


def normal_request(rng: random.Random, model: str, args, shared_urls: list[str]) -> dict:
    """One valid request: chat (text or 1-2 images) or completion, with a mix
    of lengths and sampling options."""
    long = rng.random() < 0.25
    prompt_words = rng.randint(150, 450) if long else rng.randint(3, 40)
    opts = {"model": model, "max_tokens": rng.choice([1, 4, 8, 16, 32])}
    if rng.random() < 0.5:
        opts["temperature"] = 0.0
    else:
        opts.update(temperature=rng.choice([0.7, 1.0]), top_p=0.9, seed=rng.randint(0, 10**6))
        if rng.random() < 0.4:
            opts["n"] = 2  # vLLM 0.33 rejects n > 1 with greedy sampling
    stream = rng.random() < 0.4
    if rng.random() < 0.3:  # plain completion
        opts["prompt"] = words(rng, prompt_words)
        if rng.random() < 0.4:
            opts["extra_body"] = {"prompt_logprobs": rng.choice([0, 1, 3])}
            stream = False
        if rng.random() < 0.3:
            opts["logprobs"] = 2
        return {"kind": "completion", "endpoint": "completions", "stream": stream, "body": opts}
    images = rng.choice([0, 0, 1, 1, 2]) if args.max_images >= 2 else rng.choice([0, 1])
    urls = [rng.choice(shared_urls) if rng.random() < 0.2 else data_url(noise_image(rng))
            for _ in range(images)]
    opts["messages"] = [{"role": "user", "content": [*map(image_part, urls),
                                                     {"type": "text",
                                                      "text": words(rng, prompt_words)}]}]
    if rng.random() < 0.3:
        opts.update(logprobs=True, top_logprobs=rng.choice([1, 3]))
    return {"kind": f"chat_{images}img", "endpoint": "chat", "stream": stream, "body": opts,
            "images": images}


def build_plan(args, model: str) -> list[dict]:
    """Every job of the run, shuffled; a storm job holds several requests."""
    rng = random.Random(args.seed)
    shared = [data_url(noise_image(rng)) for _ in range(4)]
    n = args.requests
    jobs = []
    per_bad = max(1, n // 100)
    for bad in bad_requests(model, args.max_images, args.max_model_len, shared[0]):
        jobs += [dict(bad, expect_4xx=True) for _ in range(per_bad)]
    for _ in range(max(1, n // 20)):  # disconnect mid-stream
        job = normal_request(rng, model, args, shared)
        job["body"]["max_tokens"] = 64
        job["body"].pop("extra_body", None)
        jobs.append(dict(job, stream=True, disconnect_after=rng.randint(1, 4)))
    storm_left = max(4, n // 10)
    while storm_left > 0:
        size = min(storm_left, rng.randint(4, 16))
        jobs.append({"kind": "storm", "burst": [normal_request(rng, model, args, shared)
                                                 for _ in range(size)]})
        storm_left -= size
    while sum(len(j.get("burst", [j])) for j in jobs) < n:
        jobs.append(normal_request(rng, model, args, shared))
    rng.shuffle(jobs)
    return jobs


# ---- sending --------------------------------------------------------------------

@dataclass
class Results:
    done: int = 0
    failed: list[str] = field(default_factory=list)
    bad: list[tuple[str, int | None]] = field(default_factory=list)  # (kind, status)
    disconnected: int = 0
    aborted: int = 0
    drift_retries: int = 0
    latencies_ms: list[float] = field(default_factory=list)


def check_reply(job: dict, reply) -> None:
    body = job["body"]
    n = body.get("n", 1)
    assert len(reply.choices) == n, f"{len(reply.choices)} choices, asked {n}"
    assert reply.usage.completion_tokens >= n, reply.usage
    for choice in reply.choices:
        assert choice.finish_reason in ("length", "stop"), choice.finish_reason
        if body.get("logprobs"):
            assert choice.logprobs is not None, "no logprobs"
    prompt_logprobs = (body.get("extra_body") or {}).get("prompt_logprobs")
    if prompt_logprobs is not None:
        entries = reply.choices[0].model_extra["prompt_logprobs"]
        assert len(entries) == reply.usage.prompt_tokens, "prompt_logprobs length"


async def call(client: openai.AsyncOpenAI, job: dict, stream: bool):
    api = client.chat.completions if job["endpoint"] == "chat" else client.completions
    body = dict(job["body"])
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return await api.create(**body)


async def consume_stream(job: dict, stream) -> None:
    """Read a whole stream; check every choice finished and usage arrived."""
    finished, usage = set(), None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.finish_reason:
                finished.add(choice.index)
    n = job["body"].get("n", 1)
    assert finished == set(range(n)), f"finished choices {finished}, asked {n}"
    assert usage is not None and usage.completion_tokens >= n, usage


def server_error(error: Exception) -> bool:
    """A 500, or an error event inside a stream (no status code)."""
    return isinstance(error, openai.APIError) and (
        not isinstance(error, openai.APIStatusError) or error.status_code >= 500)


async def run_normal(client, job: dict, res: Results) -> None:
    """Send one request and check its reply. An image request that gets a
    server error is sent once more: vLLM 0.33 answers a drift between its
    front-end and engine multimodal caches with a retryable error and expects
    the client to resend (`MultiModalCacheMissError`); the caller checks that
    the server log names one drift per retry."""
    start = time.perf_counter()
    for attempt in range(2):
        try:
            if job.get("stream"):
                await consume_stream(job, await call(client, job, stream=True))
            else:
                check_reply(job, await call(client, job, stream=False))
            break
        except Exception as error:  # noqa: BLE001 - every failure is counted and shown
            if attempt == 0 and job.get("images") and server_error(error):
                res.drift_retries += 1
                continue
            res.failed.append(f"{job['kind']}: {type(error).__name__}: {str(error)[:200]}")
            return
    res.done += 1
    res.latencies_ms.append((time.perf_counter() - start) * 1000)


async def run_bad(client, job: dict, res: Results) -> None:
    try:
        await call(client, job, stream=False)
    except openai.APIStatusError as error:
        res.bad.append((job["kind"], error.status_code))
        return
    except Exception as error:  # noqa: BLE001
        res.bad.append((job["kind"], None))
        res.failed.append(f"{job['kind']}: {type(error).__name__}: {str(error)[:200]}")
        return
    res.bad.append((job["kind"], 200))


async def run_disconnect(client, job: dict, res: Results) -> None:
    """Stream, read a few chunks, then drop the connection."""
    try:
        stream = await call(client, job, stream=True)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks >= job["disconnect_after"]:
                break
        await stream.close()
    except Exception as error:  # noqa: BLE001
        res.failed.append(f"disconnect: {type(error).__name__}: {str(error)[:200]}")
        return
    res.disconnected += 1


async def run_storm(client, job: dict, res: Results, rng: random.Random) -> None:
    """Start a burst of requests together and cancel them all within ~50 ms."""
    tasks = [asyncio.create_task(call(client, j, stream=bool(j.get("stream"))))
             for j in job["burst"]]
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            reply = await task
        except asyncio.CancelledError:
            res.aborted += 1
        except Exception as error:  # noqa: BLE001
            res.failed.append(f"storm: {type(error).__name__}: {str(error)[:200]}")
        else:  # finished before the cancel: close an open stream, count it done
            if hasattr(reply, "close"):
                await reply.close()
            res.aborted += 1


async def send_all(base: str, jobs: list[dict], args) -> Results:
    res = Results()
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=args.request_timeout,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(
                                    max_connections=args.concurrency + 32)))

    async def one(job):
        async with limit:
            if job["kind"] == "storm":
                await run_storm(client, job, res, rng)
            elif job.get("expect_4xx"):
                await run_bad(client, job, res)
            elif "disconnect_after" in job:
                await run_disconnect(client, job, res)
            else:
                await run_normal(client, job, res)

    try:
        await asyncio.wait_for(asyncio.gather(*map(one, jobs)), args.load_timeout)
    except asyncio.TimeoutError:
        res.failed.append(f"load not finished in {args.load_timeout:.0f} s")
    finally:
        await client.close()
    return res


async def still_serving(base: str, model: str, url: str) -> bool:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=60)
    try:
        reply = await client.chat.completions.create(
            model=model, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [image_part(url),
                                                   {"type": "text", "text": "Still there?"}]}])
        return reply.usage.completion_tokens == 4
    except Exception as error:  # noqa: BLE001
        log(f"final request failed: {error}")
        return False
    finally:
        await client.close()


# ---- report ---------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def invariants(summary: dict) -> list[str]:
    """What must hold after the load; each failure is named."""
    s = summary
    problems = []
    if s["failed"]:
        problems.append(f"{s['failed']} failed requests")
    if not all(code is not None and 400 <= code < 500 for _, code in s["bad_codes"]):
        problems.append(f"deliberately bad requests not all 4xx: {s['bad_codes']}")
    if s["kv_usage_after"] != 0:
        problems.append(f"KV cache usage {s['kv_usage_after']} once idle")
    state = s["runner_state"]
    held = {k: state.get(k) for k in ("requests", "batch_requests", "prompt_logprobs_pending",
                                      "rope_positions")}
    if any(held.values()):
        problems.append(f"runner still holds request state once idle: {held}")
    if state.get("encoder_cache_rows", 0) > s["encoder_cache_bound"]:
        problems.append(f"encoder cache holds {state['encoder_cache_rows']} rows, more than "
                        f"vLLM's budget {s['encoder_cache_bound']}")
    if s["encoder_cache_after_reset"] != 0:
        problems.append(f"{s['encoder_cache_after_reset']} encoder cache entries after "
                        "vLLM's reset_encoder_cache")
    if s["runtime_compiles"] or state.get("runtime_compiles"):
        problems.append(f"compiles at run time: {s['runtime_compiles']} logged, "
                        f"{state.get('runtime_compiles')} counted")
    if s["drift_retries"] > s["mm_cache_drift_logged"]:
        problems.append(f"{s['drift_retries']} image requests retried after a server error, "
                        f"only {s['mm_cache_drift_logged']} multimodal cache drifts logged")
    if not s["alive"]:
        problems.append("server not answering after the load")
    return problems


def final_line(s: dict) -> str:
    state = s["runner_state"]
    return (f"serve_load: requests={s['requests']} done={s['done']} failed={s['failed']} "
            f"bad_4xx={s['bad_4xx']} disconnected={s['disconnected']} aborted={s['aborted']} "
            f"mm_drift_retries={s['drift_retries']} "
            f"p50_ms={s['p50_ms']:.0f} p90_ms={s['p90_ms']:.0f} p99_ms={s['p99_ms']:.0f} "
            f"wall_s={s['wall_s']:.1f} rss_before_mb={s['rss_before_mb']:.0f} "
            f"rss_after_mb={s['rss_after_mb']:.0f} "
            + (f"rss_after_passes_mb={','.join(f'{m:.0f}' for m in s['rss_after_passes_mb'])} "
               if s.get("rss_after_passes_mb") else "")
            + f"kv_usage_after={s['kv_usage_after']} "
            f"runner_requests_after={state.get('requests')} "
            f"encoder_cache_after={state.get('encoder_cache_entries')} "
            f"encoder_cache_rows={state.get('encoder_cache_rows')}/{s['encoder_cache_bound']} "
            f"encoder_cache_after_reset={s['encoder_cache_after_reset']} "
            f"runtime_compiles={s['runtime_compiles']} alive={'yes' if s['alive'] else 'no'}")


# ---- main -----------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the tiny LlavaNext fixture)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--passes", type=int, default=1,
                   help="send that many loads of --requests (new images each) to one "
                        "server, RSS read after each: does memory level off?")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--compile-backend", choices=["eager", "inductor"], default="eager")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-images", type=int, default=2, help="--limit-mm-per-prompt image")
    p.add_argument("--kv-space", type=float, default=0.25, help="VLLM_ACCEL_KVCACHE_SPACE, GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--load-timeout", type=float, default=1800, help="seconds for the whole load")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--idle-timeout", type=float, default=30,
                   help="seconds to wait for the server to go idle after the load")
    p.add_argument("--workdir", help="where the fixture and server.log go (default: a temp dir)")
    return p.parse_args(argv)


def run(args) -> dict:
    """Start the server, send the load, read its state; the summary as a dict."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="serve-load-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from vllm_accel.testing.fixtures import make_tiny_model
        model = str(make_tiny_model("llava_next", workdir / "tiny-llava-next"))
    port, log_path = free_port(), workdir / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, model, port, log_path)
    try:
        started = time.time()
        wait_ready(proc, base, log_path, args.start_timeout)
        log(f"server ready in {time.time() - started:.1f} s")
        return run_against(args, proc, base, model, log_path)
    finally:
        stop_server(proc)


def run_against(args, proc: subprocess.Popen, base: str, model: str, log_path: Path) -> dict:
    """Send the load to a server already serving ``model`` at ``base`` (started
    as ``start_server`` starts it: warmed up, VLLM_SERVER_DEV_MODE=1, the
    args' --max-model-len and --max-images); the summary as a dict."""
    jobs = []
    for i in range(args.passes):  # a new seed per pass: new images, new prompts
        jobs.append(build_plan(argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i}),
                               model))
    return asyncio.run(measure(args, proc, base, model, jobs, log_path))


async def measure(args, proc, base: str, model: str, passes: list[list[dict]],
                  log_path: Path) -> dict:
    rss_before = tree_rss_mb(proc.pid)
    res, total, wall, rss_after_passes = Results(), 0, 0.0, []
    for number, jobs in enumerate(passes, 1):
        count = sum(len(j.get("burst", [j])) for j in jobs)
        total += count
        log(f"pass {number}/{len(passes)}: sending {count} requests ({len(jobs)} jobs) "
            f"at concurrency {args.concurrency}")
        started = time.perf_counter()
        one = await send_all(base, jobs, args)
        wall += time.perf_counter() - started
        for name in ("done", "disconnected", "aborted", "drift_retries"):
            setattr(res, name, getattr(res, name) + getattr(one, name))
        res.failed += one.failed
        res.bad += one.bad
        res.latencies_ms += one.latencies_ms
        if len(passes) > 1:
            async with httpx.AsyncClient(base_url=base) as http:
                await wait_idle(http, args.idle_timeout)
            rss_after_passes.append(tree_rss_mb(proc.pid))
            log(f"pass {number}: RSS {rss_after_passes[-1]:.0f} MB")
    async with httpx.AsyncClient(base_url=base) as http:
        kv_usage, busy = await wait_idle(http, args.idle_timeout)
        state = await runner_state(http)
        rss_after = tree_rss_mb(proc.pid)
        # vLLM keeps finished requests' encoder outputs until it needs the space;
        # its dev-mode reset must empty the runner's copy too.
        (await http.post("/reset_encoder_cache", timeout=30)).raise_for_status()
        after_reset = (await runner_state(http))["encoder_cache_entries"]
        alive = (proc.poll() is None and (await http.get("/health")).status_code == 200
                 and await still_serving(base, model, data_url(Image.new("RGB", (90, 60)))))
    server_log = log_path.read_text()
    warmup = WARMUP_LINE.search(server_log)
    log(warmup.group(0) if warmup else "no warmup line in the server log")
    for failure in res.failed[:10]:
        log(f"FAILED {failure}")
    return {
        "requests": total, "done": res.done, "failed": len(res.failed),
        "failures": res.failed, "bad_codes": res.bad,
        "bad_4xx": sum(1 for _, c in res.bad if c is not None and 400 <= c < 500),
        "disconnected": res.disconnected, "aborted": res.aborted,
        "drift_retries": res.drift_retries,
        "mm_cache_drift_logged": server_log.count(DRIFT_LINE),
        "p50_ms": percentile(res.latencies_ms, 50), "p90_ms": percentile(res.latencies_ms, 90),
        "p99_ms": percentile(res.latencies_ms, 99), "wall_s": wall,
        "rss_before_mb": rss_before, "rss_after_mb": rss_after,
        "rss_after_passes_mb": rss_after_passes,
        "kv_usage_after": kv_usage, "busy_after": busy, "runner_state": state,
        "encoder_cache_after_reset": after_reset,
        # vLLM's encoder cache budget: max(scheduler encoder_cache_size, one item);
        # one item never exceeds max_model_len.
        "encoder_cache_bound": max(state.get("encoder_cache_capacity", 0), args.max_model_len),
        "runtime_compiles": server_log.count(RECOMPILE_LINE),
        "warmup_line": warmup.group(0) if warmup else None,
        "alive": alive, "log_path": str(log_path),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    summary = run(args)
    log("deliberate 4xx: " + ", ".join(f"{k}={c}" for k, c in summary["bad_codes"]))
    log(f"runner state after the load: {summary['runner_state']}")
    problems = invariants(summary)
    for problem in problems:
        log(f"INVARIANT FAILED: {problem}")
    print(final_line(summary), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
