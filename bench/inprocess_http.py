"""The engine and an HTTP server in one process: no Redis, no other process. A yardstick only.

`bench/served_vs_inprocess.py --also-http` starts this beside `pacer up` to split the served
system's cost in two: what any server on the same cores pays to stream tokens over HTTP to a
client (detokenizing, SSE framing, a socket write per token, the client reading it) and what
the Redis hops and the split into processes add on top.

It serves `/health` and a streaming `/v1/completions` for the bench client's requests only:
token-id prompts, greedy (temperature 0), `max_tokens`, `ignore_eos`, usage in the last
chunk. The engine steps on a thread of its own (its kernels let go of the GIL, as in the
worker); each step's tokens go to their streams through the event loop, detokenized with the
gateway's incremental detokenizer and framed as the gateway frames them.

    python bench/inprocess_http.py --port 8123 [engine flags]
"""
from __future__ import annotations

import asyncio
import itertools
import os
import queue
import sys
import threading
import time

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_arg_parser  # noqa: E402
from gateway import openai_schema as oai  # noqa: E402
from gateway.responses import SSE_HEADERS  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from shared.detokenizer import IncrementalDetokenizer  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from shared.lifecycle import freeze_heap, run_service  # noqa: E402
from shared.outputs import RequestOutput  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402


class EngineThread:
    """Steps the engine whenever it has work; new requests come in through a queue, each
    step's outputs go back to the event loop, one call per step."""

    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, asyncio.Queue] = {}
        self.failed: str | None = None
        self._ids = itertools.count()
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def submit(self, ids: list[int], sampling: SamplingParams) -> asyncio.Queue:
        """The request's outputs as they come; a str instead if the engine failed."""
        out: asyncio.Queue = asyncio.Queue()
        if self.failed is not None:
            out.put_nowait(self.failed)
            return out
        rid = f"r{next(self._ids)}"
        self.streams[rid] = out
        self.inbox.put((rid, ids, sampling))
        return out

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:       # every stream ends with it, none waits forever
            self.loop.call_soon_threadsafe(self._fail, f"engine failed: {e!r}")
            raise

    def _fail(self, error: str) -> None:
        self.failed = error
        for stream in self.streams.values():
            stream.put_nowait(error)
        self.streams.clear()

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            while True:
                try:
                    rid, ids, sampling = self.inbox.get(block=block)
                except queue.Empty:
                    break
                self.engine.add_request(ids, sampling, request_id=rid)
                block = False
            outputs = self.engine.step()
            if outputs:
                self.loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.streams[out.request_id]
            stream.put_nowait(out)
            if out.finished:
                del self.streams[out.request_id]


def completions(engine: LLMEngine, worker: EngineThread, model: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = body["prompt"]
        if body.get("temperature", 1.0) != 0 or not isinstance(ids, list):
            raise web.HTTPBadRequest(text="this yardstick serves greedy token-id prompts only")
        sampling = SamplingParams(max_tokens=int(body["max_tokens"]), temperature=0.0,
                                  ignore_eos=bool(body.get("ignore_eos", False)))
        head = oai.envelope("completion", "cmpl-inprocess", model, int(time.time()), chunk=True)
        detok = IncrementalDetokenizer(engine.tokenizer, ids)
        outputs = worker.submit(ids, sampling)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        n = 0
        while True:
            out = await outputs.get()
            if isinstance(out, str):
                await response.write(oai.sse(oai.error_body(out, "internal_error")))
                return response
            text = "".join(detok.add(t.token_id) for t in out.new_tokens)
            n += len(out.new_tokens)
            if out.finished:
                text += detok.flush()
            if text:
                await response.write(oai.sse({**head, "choices": [
                    oai.completion_choice(0, text, None, None)]}))
            if out.finished:
                break
        usage = {"prompt_tokens": len(ids), "completion_tokens": n,
                 "total_tokens": len(ids) + n}
        await response.write(oai.sse({**head, "choices": [
            oai.completion_choice(0, "", None, out.finish_reason)]}))
        await response.write(oai.sse({**head, "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    return handle


async def serve(engine: LLMEngine, host: str, port: int, stop: asyncio.Event) -> int:
    worker = EngineThread(engine, asyncio.get_running_loop())
    app = web.Application()
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    app.router.add_post("/v1/completions", completions(engine, worker, engine.source.name))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def main() -> None:
    ap = engine_arg_parser(__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs.from_cli(args), progress=False)
    freeze_heap()            # as the services do once loaded
    sys.exit(run_service(lambda stop: serve(engine, args.host, args.port, stop)))


if __name__ == "__main__":
    main()
