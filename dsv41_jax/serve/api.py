"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions (streamed as server-sent events or
whole), models, health and Prometheus metrics, over the continuous-batching :class:`Scheduler`. Chat messages
may hold ``image_url`` parts (:mod:`dsv41_jax.serve.images`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers import Tokenizer

from dsv41_jax.sample import encode_prompts
from dsv41_jax.serve.images import ImageError, ImageInputs
from dsv41_jax.serve.metrics import Metrics
from dsv41_jax.serve.scheduler import Overloaded, Scheduler, Update
from dsv41_jax.serve.scheduler import Request as Job
from dsv41_jax.serve.schema import ChatRequest, CompletionRequest
from dsv41_jax.serve.text import ChatTemplate, ReasoningSplit, TemplateError, effort_value, image_parts


@dataclass
class Served:
    scheduler: Scheduler
    tok: Tokenizer
    template: ChatTemplate
    metrics: Metrics
    name: str
    max_seq_len: int
    vocab: int
    bos: int
    images: ImageInputs | None = None  # None: the checkpoint has no vision tower
    image_token: str = ""  # the image token's text: an image part's place in the rendered prompt


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _param(loc: tuple) -> str | None:
    """pydantic's error location -> ``messages[0].role`` (union member tags such as ``list[int]`` dropped; inside
    a list of a tagged union, ``messages[0].content[1].image_url.url``)."""
    out, tag_next = "", False
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif tag_next:  # the member's tag (the discriminator's value): not a field
            tag_next = False
        elif "tagged-union[" in part:
            tag_next = True
        elif "[" in part or part in ("str", "int", "float", "bool", "none") or part.startswith("function-"):
            break
        else:
            out += f".{part}" if out else part
    return out or None


def create_app(s: Served) -> FastAPI:
    app = FastAPI(title="dsv41 serve")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        err = max(exc.errors(), key=lambda e: len(e.get("loc", ())))  # of a union's members, the one that got furthest
        if err.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON")
        param = _param(tuple(err.get("loc", ())))
        return _error(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.get("/health")
    async def health():
        if s.scheduler.error is not None:
            return _error(503, f"the engine stopped: {s.scheduler.error}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(s.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.name, "object": "model", "created": 0, "owned_by": "dsv41",
                                            "max_model_len": s.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        _check_model(s, body.model)
        if isinstance(body.prompt, str):
            prompt = encode_prompts(s.tok, s.bos, [body.prompt])[0]
        else:
            bad = [t for t in body.prompt if not 0 <= t < s.vocab]
            if bad:
                raise ApiError(400, f"prompt: token ids outside [0, {s.vocab}): {bad[:5]}", "prompt")
            prompt = list(body.prompt)
        job = _job(s, body, prompt, "prompt", body.max_tokens, body.logprobs)
        return await _respond(s, raw, job, body, CompletionFormat(s, body, job))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, raw: Request):
        _check_model(s, body.model)
        kwargs = body.chat_template_kwargs or {}
        thinking = bool(kwargs.get("thinking", body.reasoning_effort is not None))
        messages, images = image_parts([m.model_dump(exclude_none=True) for m in body.messages], s.image_token)
        if images and s.images is None:
            raise ApiError(400, f"{images[0][0]}: this model has no vision tower: it takes no images", images[0][0])
        try:
            text = s.template.render(messages, thinking=thinking, effort=effort_value(body.reasoning_effort))
        except TemplateError as err:
            raise ApiError(400, str(err), err.param) from None
        prompt = s.tok.encode(text, add_special_tokens=False).ids
        expanded = None
        if images:  # the tower runs off the event loop
            try:
                expanded = await asyncio.to_thread(s.images.prompt, prompt, images)
            except ImageError as err:
                raise ApiError(400, str(err), err.param) from None
            prompt = expanded.ids
        top = (body.top_logprobs or 0) if body.logprobs else None
        job = _job(s, body, prompt, "messages", body.max_completion_tokens or body.max_tokens, top)
        if expanded is not None:
            job.token_types, job.image_embeds, job.keys = expanded.token_types, expanded.embeds, expanded.keys
        return await _respond(s, raw, job, body, ChatFormat(s, body, job, thinking))

    return app


def _check_model(s: Served, model: str | None) -> None:
    if model is not None and model != s.name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {s.name!r}", "model",
                       "not_found_error")


def _job(s: Served, body, prompt: list[int], field: str, max_tokens: int | None, top: int | None) -> Job:
    room = s.max_seq_len - len(prompt)
    if room < 1:
        raise ApiError(400, f"{field}: {len(prompt)} tokens leave no room to generate in this server's "
                       f"max_seq_len of {s.max_seq_len}", field)
    return Job(prompt, min(max_tokens or room, room), emit=lambda u: None, temperature=body.temperature,
               top_k=body.top_k, top_p=body.top_p, seed=body.seed, stops=body.stop or (), top_logprobs=top,
               salt=body.cache_salt)


async def _updates(s: Served, raw: Request, job: Job) -> AsyncIterator[Update]:
    """The job's updates as they come; a client that goes away cancels the job (its row is freed)."""
    q: asyncio.Queue[Update] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    job.emit = lambda u: loop.call_soon_threadsafe(q.put_nowait, u)
    try:
        s.scheduler.submit(job)
    except Overloaded as err:
        raise ApiError(err.status, str(err),
                       kind="server_error" if err.status == 503 else "rate_limit_error") from None
    finished = False
    try:
        while not finished:
            try:
                u = await asyncio.wait_for(q.get(), timeout=1.0)
            except TimeoutError:
                if await raw.is_disconnected():
                    return
                continue
            if u.error is not None:
                raise ApiError(500, f"generation failed: {u.error}", kind="server_error")
            finished = u.finish_reason is not None
            yield u
    finally:
        if not finished:
            s.scheduler.cancel(job)


async def _respond(s: Served, raw: Request, job: Job, body, fmt):
    updates = _updates(s, raw, job)
    if not body.stream:
        last = None
        async for u in updates:
            fmt.add(u)
            last = u
        if last is None:  # the client went away
            return Response(status_code=499)
        return fmt.whole(last)
    first = await anext(updates)  # errors (429 / 503) before the stream starts are plain responses

    async def events():
        try:
            for chunk in fmt.start():
                yield f"data: {json.dumps(chunk)}\n\n"
            u = first
            while u is not None:
                for chunk in fmt.chunks(u):
                    yield f"data: {json.dumps(chunk)}\n\n"
                u = await anext(updates, None)
            if body.stream_options and body.stream_options.include_usage:
                yield f"data: {json.dumps(fmt.usage_chunk())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await updates.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


class _Format:
    """Shared by both endpoints: ids, usage, per-token strings."""

    object_whole = object_chunk = ""

    def __init__(self, s: Served, body, job: Job):
        self.s, self.body, self.job = s, body, job
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())
        self.ids: list[int] = []
        self.prompt_tokens = self.completion_tokens = 0

    def token(self, t: int) -> str:
        return self.s.tok.decode([t], skip_special_tokens=False)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.s.name}

    def count(self, u: Update) -> None:
        self.ids += u.token_ids
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens

    def usage_chunk(self) -> dict:
        return {**self.head(self.object_chunk), "choices": [], "usage": self.usage()}

    def extra(self, ids: list[int]) -> dict:
        return {"token_ids": ids} if self.body.return_token_ids else {}


class CompletionFormat(_Format):
    prefix, object_whole, object_chunk = "cmpl", "text_completion", "text_completion"

    def __init__(self, s, body, job):
        super().__init__(s, body, job)
        self.text, self.lps = "", []

    def logprobs(self, u: Update) -> dict | None:
        if self.job.top_logprobs is None:
            return None
        tokens = [self.token(t) for t in u.token_ids]
        offsets, at = [], len(self.text)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in u.logprobs],
                "top_logprobs": [self.top(top) for _, top in u.logprobs],
                "text_offset": offsets}

    def top(self, pairs: list[tuple[int, float]]) -> dict[str, float]:
        """{text: logprob}, most likely first; ids that decode to the same text keep the likelier one."""
        out: dict[str, float] = {}
        for i, v in pairs:
            out.setdefault(self.token(i), v)
        return out

    def add(self, u: Update) -> None:
        self.count(u)
        lp = self.logprobs(u)
        self.text += u.text
        if lp is not None:
            self.lps.append(lp)

    def whole(self, last: Update) -> dict:
        lps = None
        if self.lps:
            lps = {k: sum((p[k] for p in self.lps), []) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                   "text_offset")}
        choice = {"index": 0, "text": self.text, "logprobs": lps, "finish_reason": last.finish_reason,
                  **self.extra(self.ids)}
        return {**self.head(self.object_whole), "choices": [choice], "usage": self.usage()}

    def start(self) -> list[dict]:
        return []

    def chunks(self, u: Update) -> list[dict]:
        self.count(u)
        lp = self.logprobs(u)
        self.text += u.text
        if not (u.text or u.finish_reason or lp or (self.body.return_token_ids and u.token_ids)):
            return []
        choice = {"index": 0, "text": u.text, "logprobs": lp, "finish_reason": u.finish_reason,
                  **self.extra(u.token_ids)}
        return [{**self.head(self.object_chunk), "choices": [choice]}]


class ChatFormat(_Format):
    prefix, object_whole, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, s, body, job, thinking: bool):
        super().__init__(s, body, job)
        self.split = ReasoningSplit(thinking)
        self.reasoning, self.content, self.lps = "", "", []

    def logprobs(self, u: Update) -> dict | None:
        if self.job.top_logprobs is None:
            return None

        def one(t, lp):
            text = self.token(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]}
                            for t, (lp, top) in zip(u.token_ids, u.logprobs, strict=True)]}

    def add(self, u: Update) -> None:
        self.count(u)
        reasoning, content = self.split.push(u.text, final=u.finish_reason is not None)
        self.reasoning += reasoning
        self.content += content
        lp = self.logprobs(u)
        if lp is not None:
            self.lps += lp["content"]

    def whole(self, last: Update) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        choice = {"index": 0, "message": message, "logprobs": None if self.job.top_logprobs is None else
                  {"content": self.lps}, "finish_reason": last.finish_reason, **self.extra(self.ids)}
        return {**self.head(self.object_whole), "choices": [choice], "usage": self.usage()}

    def start(self) -> list[dict]:
        return [{**self.head(self.object_chunk),
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]

    def chunks(self, u: Update) -> list[dict]:
        self.count(u)
        reasoning, content = self.split.push(u.text, final=u.finish_reason is not None)
        lp = self.logprobs(u)
        delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if not (delta or u.finish_reason or lp or (self.body.return_token_ids and u.token_ids)):
            return []
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": u.finish_reason,
                  **self.extra(u.token_ids)}
        return [{**self.head(self.object_chunk), "choices": [choice]}]
