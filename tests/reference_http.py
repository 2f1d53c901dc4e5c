"""The reference frontend's HTTP service (Dynamo 1.6.1's ``HttpService``, from ai-dynamo-runtime) on
``--port``, serving ``--model`` for chat and text completions from an in-process engine that answers
every request with one short chunk. Tests start it as a process to compare how the reference counts
requests in ``/metrics`` with kvroute. The service binds every interface (it takes no host); tests send
to 127.0.0.1 only. Prints ``ready`` once the models are registered."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from dynamo.llm import HttpAsyncEngine, HttpService
from dynamo.runtime import DistributedRuntime


async def _answer(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
    model = request.get("model", "")
    if "messages" in request:
        delta = {"role": "assistant", "content": "ok"}
        yield {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": "stop"}]}  # fmt: skip
    else:
        yield {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
               "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}  # fmt: skip


async def main(port: int, model: str) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    service = HttpService(port=port)
    engine = HttpAsyncEngine(_answer, loop)
    service.add_chat_completions_model(model, "kvroute-test", engine)
    service.add_completions_model(model, "kvroute-test", engine)
    for endpoint in ("chat", "completion", "responses"):
        service.enable_endpoint(endpoint, True)
    print("ready", flush=True)
    await service.run(runtime)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.port, args.model))
