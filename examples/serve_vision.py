"""Ask a served vision-language model about an image over the OpenAI API.

    .venv/bin/python examples/serve_vision.py [--image PATH] [--question TEXT]
    .venv/bin/python examples/serve_vision.py --base-url http://HOST:PORT/v1 [--model NAME]

Without --base-url it serves a checkpoint itself: --model DIR, or by default a
tiny random-weight LlavaNext (Granite-Vision-like) written offline under
.cache/. It starts `vllm serve` on 127.0.0.1 with the vllm-accel platform,
waits for /health, asks, prints the answer and stops the server. With
--base-url it asks a server that is already running (e.g. a real Granite
Vision checkpoint); --model then names the served model (default: the first
one the server lists). The image travels as a base64 data URL in the chat
message; without --image a deterministic picture is drawn.
"""

import argparse
import base64
import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def demo_image(width: int = 160, height: int = 96):
    """A deterministic picture: a colour gradient with a few shapes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height))
    image.putdata([(255 * x // width, 255 * y // height, 128)
                   for y in range(height) for x in range(width)])
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height * 7 // 8), fill=(240, 200, 0))
    draw.rectangle((width * 5 // 8, height // 4, width * 7 // 8, height * 3 // 4),
                   fill=(20, 40, 200))
    return image


def default_max_model_len(model: str, trust_remote_code: bool = False) -> int:
    """8192 tokens (room for a few images), or the model's context if shorter."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(
        model, trust_remote_code=trust_remote_code).get_text_config()
    return min(8192, getattr(text_config, "max_position_embeddings", 8192))


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(client, model: str, image_url: str, question: str, max_tokens: int) -> str:
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": question},
    ]}]
    reply = client.chat.completions.create(model=model, messages=messages,
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


@contextlib.contextmanager
def local_server(model: str, max_model_len: int, dtype: str, trust_remote_code: bool = False):
    """`vllm serve MODEL` on a free port of 127.0.0.1; yields the /v1 base URL."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_PLUGINS="accel")
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", model,
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len)]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    print(f"starting vllm serve on 127.0.0.1:{port} ...", flush=True)
    log = tempfile.TemporaryFile("w+")  # the server's output, shown if it fails
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            if server.poll() is not None or time.time() > deadline:
                log.seek(0)
                sys.exit(f"vllm serve did not come up:\n{log.read()[-3000:]}")
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            time.sleep(1)
        yield f"{base}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="OpenAI base URL of a running server, e.g. "
                        "http://127.0.0.1:8000/v1 (default: start one here)")
    parser.add_argument("--model", help="served model name with --base-url; else the "
                        "checkpoint directory to serve (default: a tiny LlavaNext)")
    parser.add_argument("--image", help="image file (default: a generated picture)")
    parser.add_argument("--question", default="What is in this image?")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="for a local server (default: 8192 or the model's context)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="for checkpoints whose config/processor is remote code (Molmo)")
    parser.add_argument("--dtype", default="float32", help="for a local server, e.g. bfloat16")
    args = parser.parse_args()

    import openai
    from PIL import Image

    image = Image.open(args.image).convert("RGB") if args.image else demo_image()
    print(f"image: {args.image or 'generated'} {image.width}x{image.height}")

    with contextlib.ExitStack() as stack:
        base_url, model = args.base_url, args.model
        if base_url is None:
            if model is None:
                from vllm_accel.testing.fixtures import make_tiny_model

                model = str(make_tiny_model("llava_next", REPO / ".cache" / "tiny-llava_next"))
                print(f"tiny llava_next checkpoint: {model}")
                # A small KV budget is plenty for a tiny model (the default is 4 GiB).
                os.environ.setdefault("VLLM_ACCEL_KVCACHE_SPACE", "1")
            max_len = args.max_model_len or default_max_model_len(model, args.trust_remote_code)
            base_url = stack.enter_context(local_server(model, max_len, args.dtype,
                                                        args.trust_remote_code))
        elif not base_url.rstrip("/").endswith("/v1"):
            base_url = base_url.rstrip("/") + "/v1"
        client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
        if model is None:
            model = client.models.list().data[0].id
        answer = ask(client, model, data_url(image), args.question, args.max_tokens)
        print(f"question: {args.question!r}")
        print(f"answer: {answer!r}")


if __name__ == "__main__":
    main()
