"""Embedding specdeploy in your own service: one Service, many threads (or asyncio tasks).

    python examples/embed_service.py build/test_exports/micro

Load once at startup, share the Service between request handlers, map BusyError to
"try again later" (HTTP 429), and cancel requests whose caller went away.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor

from specdeploy.runtime import AsyncRequest, BusyError, Service, SpecDeployError


def handle(svc: Service, prompt: str, request_id: str | None = None) -> dict:
    """What a synchronous request handler (Flask, a queue consumer, ...) would do.

    Validation and running are two steps so that a fault while generating is never blamed on
    the caller: bad input is a 400, a full service a 429, anything that fails later a 500.
    """
    try:
        req = svc.request(prompt, max_new_tokens=24, temperature=0.0, method=svc.default_method,
                          request_id=request_id)
    except SpecDeployError as exc:  # bad input: the message says what to fix
        return {"status": 400, "error": str(exc)}
    try:
        with req:  # frees the instance however the block ends
            result = req.result()
    except BusyError as exc:  # pool and queue full, or waited too long: shed load
        return {"status": 429, "error": str(exc)}
    except Exception:  # our fault, not the caller's (req.finish_reason is "error"): log req.id, answer 500
        return {"status": 500, "error": f"internal error (request {req.id})"}
    return {"status": 200, "text": result.text, "tokens": len(result.token_ids),
            "acceptance_length": round(result.stats["acceptance_length"], 2), "queue_s": result.stats["queue_s"]}


async def handle_async(svc: Service, prompt: str) -> str:
    """An asyncio handler: the decode loop runs in a worker thread, the event loop stays free."""
    run = AsyncRequest(svc.request(prompt, max_new_tokens=24))
    await run.start()  # BusyError here, before you send any response
    pieces = []
    async for event in run:  # stream these to your client as they come
        pieces.append(event.text)
        if len(pieces) == 8:
            run.cancel()  # e.g. the client disconnected: the worker is freed within one step
    return "".join(pieces)


def main(export_dir: str) -> int:
    # Before any ONNX Runtime session exists in this process: one thread pool for all of
    # them (every static-T graph is a session). Skip it if your process has ORT sessions
    # that must keep their own pools: ORT then requires every session to share.
    from specdeploy.runtime.backends import use_shared_threads

    use_shared_threads()
    svc = Service.load(export_dir, pool_size=2, queue_size=8, queue_timeout=10.0)
    print("loaded:", svc.status())

    prompts = ["Once upon a time", "def main():", "import numpy as np", "The weather today"]
    with ThreadPoolExecutor(4) as pool:  # four concurrent callers, two workers: two wait in the queue
        for prompt, answer in zip(prompts, pool.map(lambda p: handle(svc, p), prompts)):
            print(f"{prompt!r} -> {answer}")

    with svc.stream("Hello", max_new_tokens=16) as req:  # streaming, synchronously
        print("streamed:", repr("".join(event.text for event in req)), req.finish_reason)

    print("async, cancelled after 8 tokens:", repr(asyncio.run(handle_async(svc, "class Node:"))))
    print("bad input:", handle(svc, ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "build/test_exports/micro"))
