"""OpenAI-compatible HTTP server: `python -m numbaengine.serve --port 8000`.

POST /v1/completions and /v1/chat/completions (plain or `stream: true` server-sent events, one chunk per
committed round; rounds a stream has fallen behind on go out as one chunk), GET /v1/models, /health and /metrics
(Prometheus). One engine thread decodes every request in a continuously batched loop (numbaengine/scheduler.py); a
request's output equals Engine.generate's for its prompt and settings. Extensions: `speculative: {"mode",
"budget"}` (budget: tree nodes or "auto") and `stop_token_ids` (replacing the checkpoint's eos ids, as
Engine.generate's `stop`). Without --model it serves the shipped pair. The text of a request without stop strings
is decoded on the event loop (scheduler.Receiver), off the engine thread's path between rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import signal
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from numbaengine import generate as gen
from numbaengine.backends import BACKENDS
from numbaengine.rounds import PREFILL_CHUNK
from numbaengine.run import budget_arg
from numbaengine.scheduler import QueueFull, Receiver, Request, Scheduler, Update
from numbaengine.serve_api import (
    APIError,
    ChatBody,
    CompletionBody,
    chat_prompt,
    load_chat_template,
    parse_body,
)
from numbaengine.serve_metrics import Metrics
from numbaengine.warmup import warm_rounds
from numbaengine.weights import SHIPPED_PAIR

GONE = "the client disconnected"


class SSEResponse(StreamingResponse):
    """A streamed response that calls on_close however it ends (done, client gone, server cancelled)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def build_app(engine, scheduler: Scheduler, metrics: Metrics, name: str, defaults: dict,
              chat_template=None) -> FastAPI:
    """The FastAPI app over a started-on-startup scheduler. defaults: speculative mode and budget."""

    @asynccontextmanager
    async def lifespan(app):
        app.state.mailbox = Mailbox(asyncio.get_running_loop())
        gc.freeze()         # the engine's objects stay out of full collections: one took 65 ms, a pause of every
        #                     stream (tools.serve_overhead on a 2-core CPU, shipped pair's tokenizer, 32 streams)
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.close)     # uvicorn drained the requests: the engine thread ends

    app = FastAPI(title="numbaengine", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return await api_error(request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return await api_error(request, APIError(400, str(e)))

    @app.get("/health")
    async def health():
        return dict(status="ok", backend=engine.backend, **scheduler.load())

    @app.get("/v1/models")
    async def models():
        return dict(object="list", data=[dict(id=name, object="model", created=int(time.time()),
                                               owned_by="numbaengine", max_model_len=engine.max_context)])

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(scheduler.load()["queued"])
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = parse_body(CompletionBody, await http.body())
        ids = prompt_ids(engine, body.prompt_value(), "prompt")
        return await serve(http, body, ids, body.max_tokens or 16, "completion")

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body = parse_body(ChatBody, await http.body())
        if chat_template is None:
            raise APIError(400, "this model has no chat template (no `chat_template` in its tokenizer_config.json): "
                                "use /v1/completions", "messages", "no_chat_template")
        ids = prompt_ids(engine, chat_prompt(chat_template, body.messages), "messages")
        limit = body.max_completion_tokens or body.max_tokens or engine.max_context - len(ids)
        return await serve(http, body, ids, limit, "chat")

    async def serve(http, body, ids, max_tokens, kind):
        req, updates = scheduler_request(engine, body, ids, max_tokens, defaults, http.app.state.mailbox)
        receiver = Receiver(engine.tokenizer, req)
        try:
            scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        reply = Reply(kind, http.url.path, name, len(ids))
        try:
            first = await next_update(updates, http, scheduler, req)     # a prefill error is still a 500
            if first.error is not None:
                return failed(metrics, reply, first)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = stream(first, updates, reply, include_usage, metrics, receiver)
                return SSEResponse(events, on_close=lambda: reply.close(scheduler, req, metrics))
            u = receiver.text(first)
            text = [u.text]
            while u.finish_reason is None:
                u = receiver.text(await next_update(updates, http, scheduler, req))
                text.append(u.text)
        except BaseException:           # this handler was cancelled: its request leaves the batch
            scheduler.cancel(req)
            raise
        if u.error is not None:
            return failed(metrics, reply, u)
        metrics.done(reply.path, len(ids), u.tokens)
        return reply.full("".join(text), u)

    return app


def prompt_ids(engine, prompt, param) -> list:
    """Token ids of a prompt (text or ids), with a 400 naming `param` when it is empty, out of the vocabulary or
    too long for the context."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if len(ids) >= engine.max_context:
        raise APIError(400, f"{param}: {len(ids)} tokens do not fit the context of {engine.max_context} tokens "
                            "(it must leave room for at least one new token)", param, "context_length_exceeded")
    try:
        return gen.prompt_ids(ids, engine.tokenizer, engine.cfg.vocab_size, engine.max_context)
    except ValueError as e:
        raise APIError(400, str(e), param) from None


def scheduler_request(engine, body, ids, max_tokens, defaults, mailbox):
    """The scheduler's Request for a checked body, and the asyncio queue its updates arrive on (through mailbox)."""
    spec = body.speculative
    mode = spec.mode if spec and spec.mode else defaults["mode"]
    budget = spec.budget if spec and spec.budget is not None else defaults["budget"]
    try:
        gen.check_args(mode, budget, max_tokens, body.temperature, engine.drafter)
    except ValueError as e:
        raise APIError(400, str(e), "speculative.mode" if "mode" in str(e) else "speculative.budget") from None
    bad = [t for t in body.stop_token_ids or () if not 0 <= t < engine.cfg.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {engine.cfg.vocab_size})",
                       "stop_token_ids")
    updates = asyncio.Queue()
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    req = Request(ids, max_tokens, mode, budget, body.temperature, body.seed, body.stop_token_ids, stops,
                  functools.partial(mailbox.post, updates), decode=bool(stops))   # no stop strings: text made here
    return req, updates


class Mailbox:
    """Updates from the engine thread to the event loop: one wake-up of the loop per burst (a round's updates of
    every request), not one per update. A closed loop (shutdown) has no one to tell."""

    def __init__(self, loop):
        self.loop, self.items, self.lock, self.waking = loop, [], threading.Lock(), False

    def post(self, queue, update):
        with self.lock:
            self.items.append((queue, update))
            if self.waking:
                return
            self.waking = True
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:
            pass

    def deliver(self):
        with self.lock:
            items, self.items, self.waking = self.items, [], False
        for queue, update in items:
            queue.put_nowait(update)


async def next_update(updates, http, scheduler, req):
    """The next update; a client that went away (checked every half second) cancels the request."""
    while True:
        try:
            return await asyncio.wait_for(updates.get(), 0.5)
        except TimeoutError:
            if await http.is_disconnected():
                scheduler.cancel(req)
                return Update(finish_reason="error", error=GONE)


def failed(metrics, reply, u) -> JSONResponse:
    status = 499 if u.error == GONE else 500           # 499: nobody is left to read it
    metrics.requests.labels(reply.path, str(status)).inc()
    return APIError(500, f"the engine failed this request: {u.error}", type="server_error").response()


async def stream(first, updates, reply, include_usage, metrics, receiver):
    """Server-sent events: a chunk per update with new text (the first names the role), the finish reason on
    the last, a usage chunk when asked, then [DONE]. Updates already queued behind one (the stream is behind the
    rounds) go out as one chunk: under load the chunks grow instead of the backlog (and their ids are decoded once,
    by the receiver). An engine error mid-stream is sent as an error event."""
    u, held = first, None
    while True:
        while u.error is None and u.finish_reason is None and held is None and not updates.empty():
            v = updates.get_nowait()
            if v.error is not None:
                held = v
            else:
                u = Update(u.text + v.text, v.tokens, v.finish_reason, ids=None if u.ids is None else u.ids + v.ids)
        u = receiver.text(u)
        if u.error is not None:
            metrics.requests.labels(reply.path, "500").inc()
            reply.finished = True
            yield sse(APIError(500, f"the engine failed this request: {u.error}", type="server_error").body())
            break
        if u.text or u.finish_reason or reply.chunks == 0:
            yield sse(reply.chunk(u))
        if u.finish_reason is not None:
            reply.finished = True
            metrics.done(reply.path, reply.prompt_tokens, u.tokens)
            if include_usage:
                yield sse(reply.usage_chunk(u))
            break
        u, held = (held, None) if held is not None else (await updates.get(), None)
    yield "data: [DONE]\n\n"


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Reply:
    """OpenAI response objects of one request (completion or chat)."""

    def __init__(self, kind, path, model, prompt_tokens):
        self.kind, self.path, self.model, self.prompt_tokens, self.chunks = kind, path, model, prompt_tokens, 0
        self.finished = False
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def close(self, scheduler, req, metrics):
        """The stream ended: a request it did not finish (the client went away) leaves the batch."""
        if not self.finished:
            scheduler.cancel(req)
            metrics.requests.labels(self.path, "499").inc()

    def _head(self, obj):
        return dict(id=self.id, object=obj, created=self.created, model=self.model)

    def usage(self, u):
        return dict(prompt_tokens=self.prompt_tokens, completion_tokens=u.tokens,
                    total_tokens=self.prompt_tokens + u.tokens)

    def full(self, text, u) -> dict:
        if self.kind == "chat":
            choice = dict(index=0, message=dict(role="assistant", content=text), logprobs=None,
                          finish_reason=u.finish_reason)
            return dict(self._head("chat.completion"), choices=[choice], usage=self.usage(u))
        choice = dict(index=0, text=text, logprobs=None, finish_reason=u.finish_reason)
        return dict(self._head("text_completion"), choices=[choice], usage=self.usage(u))

    def chunk(self, u) -> dict:
        self.chunks += 1
        if self.kind == "chat":
            delta = dict(role="assistant", content=u.text) if self.chunks == 1 else dict(content=u.text)
            choice = dict(index=0, delta=delta, logprobs=None, finish_reason=u.finish_reason)
            return dict(self._head("chat.completion.chunk"), choices=[choice])
        choice = dict(index=0, text=u.text, logprobs=None, finish_reason=u.finish_reason)
        return dict(self._head("text_completion"), choices=[choice])

    def usage_chunk(self, u) -> dict:
        return dict(self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"), choices=[],
                    usage=self.usage(u))


# --- command line ------------------------------------------------------------------------------------------------------

def parser():
    ap = argparse.ArgumentParser(prog="python -m numbaengine.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target checkpoint folder (default: the shipped toy pair)")
    ap.add_argument("--draft", help="DFlash drafter folder (default: the shipped drafter without --model, else none)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: cuda when a GPU is ready, else numpy")
    ap.add_argument("--devices", type=lambda s: [int(d) for d in s.split(",")],
                    help="comma-separated GPU ids to shard over (cuda)")
    ap.add_argument("--max-context", type=int, default=4096, help="cache rows per sequence (default: %(default)s)")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default: %(default)s); on "
                    "the kernel backends a round covers the smallest bucket (1, 2, 4, ...) of slots holding every "
                    "busy one")
    ap.add_argument("--max-queue", type=int, help="requests waiting for a place before new ones get 429 (default: "
                    "twice --max-batch, at least 64: a burst of a whole batch is queued, not refused)")
    ap.add_argument("--mode", choices=gen.MODES, help="default speculative mode (default: ddtree with a drafter, "
                    "else ar)")
    ap.add_argument("--budget", type=budget_arg, default=16, help="default DDTree budget, or auto: chosen each "
                    "round (default: %(default)s)")
    ap.add_argument("--cost-table", metavar="FILE", help="budget auto's seconds of a round per batch and tree size, "
                    "JSON (numbaengine/budget.py CostTable) (default: measured at the first auto request on numpy, "
                    "when the rounds are made on cuda)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens prefilled between two "
                    "decoding rounds; longer prompts go in pieces on the kernel backends (default: %(default)s)")
    ap.add_argument("--no-warmup", action="store_true", help="cuda: take requests at once, compiling kernels and "
                    "capturing each batch bucket's graph at its first use (default: both done before serving, for "
                    "the default --mode and --budget)")
    ap.add_argument("--served-model-name", help="the model id clients see (default: the model folder's name)")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--fail-prompt", help=argparse.SUPPRESS)    # tests: a request with this prompt fails in a round
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    if args.prefill_chunk < 1:
        print(f"error: --prefill-chunk: must be a positive number of tokens, got {args.prefill_chunk}", file=sys.stderr)
        return 2
    from numbaengine.budget import CostTable
    from numbaengine.engine import Engine
    try:
        table = CostTable.load(args.cost_table) if args.cost_table else None
    except (ValueError, OSError) as e:
        print(f"error: --cost-table: {e}", file=sys.stderr)
        return 2
    model, draft = args.model, args.draft
    if model is None:
        model, draft = SHIPPED_PAIR / "target", draft or SHIPPED_PAIR / "draft"
    try:
        engine = Engine.load(model, draft, backend=args.backend, max_context=args.max_context, devices=args.devices)
    except (ValueError, OSError, ImportError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or ("numbaengine-default" if args.model is None else str(model).rstrip("/").split("/")[-1])
    metrics = Metrics(args.max_batch)
    fail_ids = engine.tokenizer.encode(args.fail_prompt) if args.fail_prompt else None
    defaults = dict(mode=args.mode or ("ddtree" if engine.drafter is not None else "ar"), budget=args.budget)

    def rounds_of():
        return engine.rounds(args.max_batch, args.prefill_chunk, cost_table=table)
    try:
        rounds = rounds_of() if args.no_warmup else warm_rounds(engine, rounds_of, args.max_batch, **defaults)
    except (ValueError, MemoryError) as e:
        print(f"error: warming up: {e}", file=sys.stderr)
        return 2
    scheduler = Scheduler(engine, args.max_batch, queue_limit(args), metrics.round, fail_ids, args.prefill_chunk,
                          rounds=rounds)
    app = build_app(engine, scheduler, metrics, name, defaults, load_chat_template(model))
    print(f"serving {name} ({engine.backend}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, drained)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def queue_limit(args) -> int:
    """--max-queue, by default twice --max-batch and at least 64 (a burst of a whole batch is queued, not refused:
    with 64 at --max-batch 128, a burst of 128 streams got 89 refusals on the H200)."""
    return args.max_queue if args.max_queue is not None else max(64, 2 * args.max_batch)


def drained(signum, frame):
    """uvicorn drains the requests on SIGTERM, then raises it again: exit 0 then."""
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
