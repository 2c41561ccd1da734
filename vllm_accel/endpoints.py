"""An endpoint plugin (vLLM's ``vllm.endpoint_plugins``): a pooling model's
server answers generation requests with a 400 that says what it serves.

vLLM registers only the routes of a model's tasks, so ``/v1/completions`` to
an embedder is a bare 404. With this plugin (loaded where ``VLLM_PLUGINS``
names ``accel``, vLLM's rule for endpoint plugins) those requests get an
OpenAI-style error naming the model's tasks and the endpoints that serve them.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Where vLLM's server answers each pooling task.
_ENDPOINTS = {
    "embed": ("/v1/embeddings", "/score", "/rerank"),
    "token_embed": ("/pooling",),
    "classify": ("/classify", "/score", "/rerank"),
    "token_classify": ("/pooling",),
}


class RefuseGeneration:
    """Generation routes on a pooling model's server: 400, naming what it serves."""

    name = "accel"
    required_tasks = POOLING_TASKS

    def attach_router(self, app: FastAPI) -> None:
        async def refuse(request: Request) -> JSONResponse:
            tasks = [t for t in getattr(request.app.state, "accel_tasks", ()) if t in _ENDPOINTS]
            endpoints = sorted({e for t in tasks for e in _ENDPOINTS[t]})
            message = (f"This model is a pooling model (tasks: {', '.join(tasks) or 'none'}): "
                       f"it does not generate text, so {request.url.path} is not served. "
                       f"Allowed: {', '.join(endpoints)}.")
            return JSONResponse(status_code=400, content={"error": {
                "message": message, "type": "BadRequestError", "param": None, "code": 400}})

        for path in GENERATION_ROUTES:
            app.add_api_route(path, refuse, methods=["POST"], include_in_schema=False)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is not None:
            state.accel_tasks = tuple(await engine_client.get_supported_tasks())
