"""`vllm serve` of the tiny LlavaNext (Granite Vision) on our platform, as a user
runs it: images as base64 data URLs over the OpenAI API, parity with HF
transformers, bad image inputs answered with a 400 while the server keeps
serving; the two vision examples end to end; and, last, a small soak of the
same server (benchmarks/serve_load.py: 60 mixed requests at concurrency 8;
afterwards the server must be clean and alive).

The server and both example runs start together (one module fixture) so that
their start-ups overlap; all use the eager backend; the examples skip the
warmup, the server warms up (the soak checks that nothing compiles while serving)."""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from helpers import wait_until_serving
from test_serve import VLLM, free_port, server_env
from vllm_accel.testing.processes import end_process_group
from vllm_accel.testing.fixtures import make_tiny_model

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LIMIT = 2  # images per prompt
MAX_MODEL_LEN = 2048
FAST = dict(VLLM_PLUGINS="accel", VLLM_ACCEL_COMPILE_BACKEND="eager", VLLM_SKIP_WARMUP="1")
QUESTION = "What is in this image?"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_vision = load_example("serve_vision")
batch_eval_vision = load_example("batch_eval_vision")


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


GOOD_URL = serve_vision.data_url(serve_vision.demo_image(120, 80))


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return make_tiny_model("llava_next", tmp_path_factory.mktemp("llava_next") / "m")


@pytest.fixture(scope="module")
def launched(llava, tmp_path_factory):
    """{name: (process, log)} for the server and the two example runs."""
    tmp = tmp_path_factory.mktemp("serve-vision")
    port = free_port()
    commands = {
        "server": [VLLM, "serve", str(llava), "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                   "--limit-mm-per-prompt", json.dumps({"image": LIMIT}), "--seed", "0"],
        "serve_example": [sys.executable, str(EXAMPLES / "serve_vision.py"), "--model",
                          str(llava)],
        "batch_example": [sys.executable, str(EXAMPLES / "batch_eval_vision.py"), "--model",
                          str(llava), "--output", str(tmp / "results.jsonl")],
    }
    # The offline example runs its engine in-process: one vLLM import less.
    # The server warms up, as serve_load.start_server starts one (the soak's checks).
    envs = {"batch_example": server_env(**FAST, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
            "server": {**server_env(**FAST, VLLM_SERVER_DEV_MODE="1"), "VLLM_SKIP_WARMUP": "0"}}
    procs = {}
    try:
        for name, cmd in commands.items():
            log = tmp / f"{name}.log"
            with open(log, "w") as log_file:
                # Own process groups: stopping one also stops the server an
                # unfinished serve_vision.py started.
                procs[name] = (subprocess.Popen(cmd, env=envs.get(name, server_env(**FAST)),
                                                cwd=tmp, stdout=log_file,
                                                stderr=subprocess.STDOUT,
                                                start_new_session=True), log)
        yield {"port": port, "tmp": tmp, **procs}
    finally:
        for proc, _ in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + 30
        for proc, _ in procs.values():
            end_process_group(proc, deadline)


@contextlib.contextmanager
def vllm_server(model, workdir: Path, *args: str, env: dict):
    """`vllm serve model args...` on a free local port, logging to
    workdir/server.log; yields (base URL, log path) once /health answers."""
    log, port = workdir / "server.log", free_port()
    cmd = [VLLM, "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, log)
        yield base, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        end_process_group(proc, time.time() + 30)


@contextlib.contextmanager
def two_image_server(model, workdir: Path):
    """`vllm serve` of a tiny vision checkpoint as the family tests serve it
    (float32, eager, two images a prompt): yields (base URL, model, log)."""
    with vllm_server(model, workdir, "--dtype", "float32", "--max-model-len", "2048",
                     "--limit-mm-per-prompt", json.dumps({"image": 2}),
                     env=server_env(**FAST)) as (base, log):
        yield base, str(model), log


def finished(launched, name: str) -> str:
    """The output of an example run, once it has exited successfully."""
    proc, log = launched[name]
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still running after 300 s:\n{log.read_text()[-4000:]}")
    output = log.read_text()
    assert proc.returncode == 0, f"{name} failed:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def server(launched, llava):
    proc, log = launched["server"]
    base = f"http://127.0.0.1:{launched['port']}"
    wait_until_serving(proc, base, log)
    return base, str(llava), log


def ask(client, model, messages, max_tokens=8, **extra):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **extra)


def assert_still_serving(client, model):
    reply = ask(client, model, user(image_part(GOOD_URL), text(QUESTION)))
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8


def test_log_names_our_platform(server):
    _, _, log = server
    assert "vllm-accel platform active: device backend 'cpu'" in log.read_text()


def assert_image_chat_matches_hf(client, model: str, hf_class: str,
                                 special_tokens: bool = False) -> None:
    """An image chat (GOOD_URL, QUESTION) through the server: the same prompt
    ids and greedy tokens as HF's ``hf_class`` on the checkpoint ``model``,
    its answer their text. As the server renders it: the content list
    [image, text] through the chat template; where the template brings the
    bos, no special tokens added (``special_tokens``: the tokenizer adds its
    own, as Qwen2.5-VL's adds none)."""
    import transformers
    from PIL import Image

    from vllm_accel.patches import apply_patches

    reply = ask(client, model, user(image_part(GOOD_URL), text(QUESTION)),
                extra_body={"return_token_ids": True})
    answer = reply.choices[0].message.content
    assert answer and reply.choices[0].finish_reason == "length"

    apply_patches()  # processors without torchvision
    processor = transformers.AutoProcessor.from_pretrained(model)
    hf = getattr(transformers, hf_class).from_pretrained(model, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, text(QUESTION)]}],
        add_generation_prompt=True)
    image = Image.open(io.BytesIO(base64.b64decode(GOOD_URL.split(",", 1)[1])))
    inputs = processor(images=image.convert("RGB"), text=prompt, return_tensors="pt",
                       **({} if special_tokens else {"add_special_tokens": False}))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    expected = out[0, inputs.input_ids.shape[1]:].tolist()

    assert reply.prompt_token_ids == inputs.input_ids[0].tolist()
    assert reply.choices[0].token_ids == expected
    assert answer == processor.tokenizer.decode(expected, skip_special_tokens=True)


def assert_batch_example_runs(model_dir, tmp_path) -> None:
    """examples/batch_eval_vision.py on ``model_dir``: an answer per sample, in order."""
    out = tmp_path / "results.jsonl"
    run = subprocess.run([sys.executable, str(EXAMPLES / "batch_eval_vision.py"), "--model",
                          str(model_dir), "--output", str(out)],
                         env=server_env(**FAST, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == list(range(len(results))) and results
    assert all(r["answer"] for r in results)


def test_image_chat_matches_hf(server, client, llava):
    """Same prompt ids and the same greedy tokens as HF's LlavaNext for a data-URL image."""
    _, model, _ = server
    assert_image_chat_matches_hf(client, model, "LlavaNextForConditionalGeneration")


BAD_IMAGES = {
    # payload -> what vLLM 0.33 says
    "not base64": ("data:image/png;base64,%%%not-base64%%%", "Non-base64 digit found"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"no png here").decode(),
                     "Failed to load image: cannot identify image file"),
    "truncated png": ("data:image/png;base64," + base64.b64encode(
        base64.b64decode(GOOD_URL.split(",", 1)[1])[:120]).decode(),
        "Failed to load image: image file is truncated"),
}


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_corrupt_image_is_a_400_and_server_keeps_serving(server, client, kind):
    _, model, _ = server
    url, message = BAD_IMAGES[kind]
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(image_part(url), text(QUESTION)))
    assert error.value.status_code == 400
    assert message in error.value.message
    assert_still_serving(client, model)


def test_too_many_images_is_a_400_and_server_keeps_serving(server, client):
    _, model, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, model, user(*[image_part(GOOD_URL)] * (LIMIT + 1), text(QUESTION)))
    assert error.value.status_code == 400
    assert f"At most {LIMIT} image(s) may be provided in one prompt" in error.value.message
    assert_still_serving(client, model)


def outcome(call):
    try:
        return call()
    except openai.APIStatusError as error:
        return error


def assert_rejected(result):
    """A 400 naming the image token; anything accepted is described precisely."""
    if isinstance(result, openai.APIStatusError):
        assert result.status_code == 400, f"{result.status_code}: {result.message}"
        assert "image" in result.message.lower(), result.message
        return
    choice = result.choices[0]
    answer = choice.message.content if hasattr(choice, "message") else choice.text
    pytest.fail(f"accepted with 200: {result.usage.prompt_tokens} prompt tokens, "
                f"answer {answer!r}")


def test_image_token_in_text_besides_an_image_is_a_400(server, client):
    """The literal `<image>` in the text adds a second image token for one image.
    HF's LlavaNext rejects the mismatch; vLLM 0.33 expands only the first
    `<image>` and feeds the stray one to the model as an ordinary token. vLLM
    calls Platform.validate_request with the processed prompt ids and image
    placeholders, so our platform can turn this into a 400."""
    _, model, _ = server
    result = outcome(lambda: ask(client, model, user(image_part(GOOD_URL),
                                                     text("<image> " + QUESTION))))
    assert_still_serving(client, model)
    assert_rejected(result)


def test_image_token_without_image_data_is_a_400(server, client):
    """A completion prompt with `<image>` but no image: one image token, no
    image features (HF rejects it; vLLM 0.33 runs it)."""
    _, model, _ = server
    result = outcome(lambda: client.completions.create(
        model=model, prompt="<image>\n" + QUESTION, max_tokens=8, temperature=0))
    assert_still_serving(client, model)
    assert_rejected(result)


# --------------------------------------------------------------------------
# The examples, end to end on the tiny fixture.
# --------------------------------------------------------------------------

def answer_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("answer: ")]
    assert len(lines) == 1, output[-4000:]
    answer = ast.literal_eval(lines[0].removeprefix("answer: "))  # printed as repr()
    assert isinstance(answer, str) and answer.strip()
    return answer


def test_serve_example_own_server_and_base_url_agree(launched, server):
    """Without --base-url it serves the checkpoint itself; with --base-url it asks
    ours (model name from /v1/models): same image and question, same answer."""
    own = answer_line(finished(launched, "serve_example"))
    base, _, _ = server
    remote = subprocess.run(
        [sys.executable, str(EXAMPLES / "serve_vision.py"), "--base-url", base],
        env=server_env(**FAST), capture_output=True, text=True, timeout=120)
    assert remote.returncode == 0, remote.stdout + remote.stderr
    assert answer_line(remote.stdout) == own


def test_batch_example_in_input_order_and_equal_to_one_by_one(launched, server, client):
    output = finished(launched, "batch_example")
    results = [json.loads(line)
               for line in (launched["tmp"] / "results.jsonl").read_text().splitlines()]
    samples = batch_eval_vision.default_samples()
    assert [r["index"] for r in results] == list(range(len(samples)))
    assert [r["question"] for r in results] == [s.question for s in samples]
    assert [r["images"] for r in results] == [s.labels for s in samples]
    assert {len(s.images) for s in samples} == {0, 1, 2}
    assert f"wrote {len(samples)} results" in output

    _, model, _ = server
    alone = [ask(client, model,
                 user(*[image_part(serve_vision.data_url(im)) for im in s.images],
                      text(s.question)),
                 max_tokens=16).choices[0].message.content
             for s in samples]
    assert [r["answer"] for r in results] == alone
    assert len(set(alone)) == len(alone)  # all different: the order check means something


def test_batch_example_reads_jsonl_with_relative_image_paths(tmp_path):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (30, 20), (255, 0, 0)).save(tmp_path / "imgs" / "red.png")
    Image.new("L", (10, 40)).save(tmp_path / "imgs" / "gray.png")
    (tmp_path / "samples.jsonl").write_text(
        json.dumps({"images": ["imgs/red.png", "imgs/gray.png"], "question": "Two?"}) + "\n\n"
        + json.dumps({"question": "None?"}) + "\n")
    samples = batch_eval_vision.read_samples(str(tmp_path / "samples.jsonl"))
    assert [(len(s.images), s.question, s.labels, s.error) for s in samples] == [
        (2, "Two?", ["imgs/red.png", "imgs/gray.png"], None), (0, "None?", [], None)]
    assert [im.size for im in samples[0].images] == [(30, 20), (10, 40)]
    assert {im.mode for im in samples[0].images} == {"RGB"}


# ---- the soak: last, on the same server --------------------------------------

SERVE_LOAD = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def soak(launched, server, tmp_path_factory):
    spec = importlib.util.spec_from_file_location("serve_load", SERVE_LOAD)
    serve_load = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = serve_load  # its dataclass looks its module up
    spec.loader.exec_module(serve_load)
    args = serve_load.parse_args([
        "--requests", "60", "--concurrency", "8", "--load-timeout", "240",
        "--request-timeout", "120", "--max-model-len", str(MAX_MODEL_LEN),
        "--max-images", str(LIMIT), "--workdir", str(tmp_path_factory.mktemp("serve-load"))])
    base, model, log = server
    summary = serve_load.run_against(args, launched["server"][0], base, model, log)
    print(serve_load.final_line(summary))
    return serve_load, summary


def test_soak_every_request_accounted_for(soak):
    _, s = soak
    assert s["failed"] == 0, s["failures"]
    assert s["requests"] == 60
    assert s["done"] + s["bad_4xx"] + s["disconnected"] + s["aborted"] == s["requests"]
    assert s["disconnected"] >= 1 and s["aborted"] >= 4
    assert s["done"] >= 40 and s["p50_ms"] > 0


def test_soak_deliberately_bad_requests_each_get_a_4xx(soak):
    _, s = soak
    assert sorted(kind for kind, _ in s["bad_codes"]) == [
        "corrupt_image", "too_long_prompt", "too_many_images"]
    assert all(code == 400 for _, code in s["bad_codes"]), s["bad_codes"]


def test_soak_server_clean_and_alive_afterwards(soak):
    serve_load, s = soak
    assert s["kv_usage_after"] == 0.0
    state = s["runner_state"]
    assert state["requests"] == state["batch_requests"] == 0, state
    assert state["prompt_logprobs_pending"] == state["rope_positions"] == 0, state
    # vLLM keeps encoder outputs of finished requests until it needs the space
    # (EncoderCacheManager.freeable), and the runner mirrors it: bounded, not 0.
    assert state["encoder_cache_rows"] <= s["encoder_cache_bound"], state
    assert s["encoder_cache_after_reset"] == 0
    assert s["runtime_compiles"] == 0 and state["runtime_compiles"] == 0
    assert s["warmup_line"] is not None
    assert s["alive"]
    assert serve_load.invariants(s) == []
