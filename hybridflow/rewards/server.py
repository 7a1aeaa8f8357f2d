"""``hybridflow serve-reward RULE``: a rule reward over HTTP, on starlette + uvicorn (h11).

Wire format (JSON only, both directions; ``hybridflow.rewards.remote`` is the client;
``hybridflow.rewards.ray_serve`` serves the same app on Ray Serve replicas)::

    POST /score   {"prompts": [str], "responses": [str], "ground_truths": [str]}
               -> 200 {"scores": [float]}      one number per sample, finite in float32
               -> 4xx/5xx {"error": str}       the request or the rule failed
    GET  /health  -> {"ok": true}

Limits, none of which a client can talk its way round (``ServerLimits``):

- body: ``max_request_bytes``, counted while the body streams in (a ``Content-Length`` over it is
  refused before reading; a chunked body is cut off at the limit); a malformed
  ``Content-Length`` (``-1``) is refused by the HTTP parser itself (400);
- JSON nesting: at most ``max_depth`` levels (the schema needs 2), checked before parsing, so a
  200,000-deep body is a 400, not a ``RecursionError``;
- headers: ``max_header_bytes``, while they arrive (h11's incomplete-event limit: 400) and once
  complete (431);
- time: the request line and headers must arrive within ``header_timeout_s`` of the connection
  (or of the previous response), the body within ``body_timeout_s`` (408); an idle keep-alive
  connection closes after ``keep_alive_s``;
- load: a listen backlog of ``backlog``, at most ``max_connections`` connections and requests at
  once (uvicorn answers 503 beyond), and the rule runs on at most ``rule_threads`` threads.

A rule that raises, returns a non-number or a value not finite in float32 makes the reply a 500
with the reason (the client counts it as that component's error); a reply is never
``Infinity``/``NaN``, which are not JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridflow.data.echo import shorten
from hybridflow.rewards.rule import RewardError, load_rule, score_texts_guarded

RuleFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class ServerLimits:
    """The server's bounds (module docstring)."""

    max_request_bytes: int = 1 << 20
    max_depth: int = 32
    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: int = 5
    backlog: int = 2048
    max_connections: int = 2048
    rule_threads: int = 4


class _RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def json_reply(status: int, obj: object, close: bool = False) -> Response:
    """A JSON response; ``allow_nan=False`` so a non-finite number can never go out as
    ``Infinity``."""
    headers = {"connection": "close"} if close else None
    return Response(json.dumps(obj, allow_nan=False), status, headers, media_type="application/json")


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped whole) and brackets


def json_depth(body: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text (brackets inside strings not counted)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def parse_request(body: bytes, max_depth: int) -> tuple[list[str], list[str], list[str]]:
    """``(prompts, responses, ground_truths)`` of a ``/score`` body; ValueError naming what is
    wrong."""
    depth = json_depth(body)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep > {max_depth}")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ValueError("body is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    fields = []
    for key in ("prompts", "responses", "ground_truths"):
        value = obj.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key!r} must be a list of strings")
        fields.append(value)
    if len({len(f) for f in fields}) != 1:
        raise ValueError("prompts, responses and ground_truths must have the same length")
    return fields[0], fields[1], fields[2]


async def _read_body(request: Request, limits: ServerLimits) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limits.max_request_bytes:  # h11 checked it is a number
        raise _RequestError(413, f"body of {declared} bytes > {limits.max_request_bytes}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_request_bytes:
                    raise _RequestError(413, f"body over {limits.max_request_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise _RequestError(408, f"body not received within {limits.body_timeout_s:g} s") from None
    return b"".join(chunks)


def make_app(fn: RuleFn, limits: ServerLimits = ServerLimits()) -> Starlette:
    """The ASGI app scoring ``POST /score`` with the rule ``fn``."""
    threads = anyio.CapacityLimiter(limits.rule_threads)

    def score(prompts, responses, truths) -> list[float]:
        scores, _ = score_texts_guarded(fn, prompts, responses, truths, on_error="fail", timeout_s=None)
        return scores.tolist()

    async def score_endpoint(request: Request) -> Response:
        header_bytes = sum(len(k) + len(v) for k, v in request.scope["headers"])
        if header_bytes > limits.max_header_bytes:  # h11 bounds headers still arriving, not whole ones
            return json_reply(431, {"error": f"headers of {header_bytes} bytes > {limits.max_header_bytes}"},
                              close=True)
        try:
            body = await _read_body(request, limits)
            try:
                prompts, responses, truths = parse_request(body, limits.max_depth)
            except ValueError as exc:
                raise _RequestError(400, str(exc)) from None
        except _RequestError as exc:  # the unread rest of the body must not be read as a request
            return json_reply(exc.status, {"error": str(exc)}, close=True)
        except ClientDisconnect:
            return json_reply(400, {"error": "client disconnected"}, close=True)
        try:
            scores = await anyio.to_thread.run_sync(score, prompts, responses, truths, limiter=threads)
        except RewardError as exc:
            return json_reply(500, {"error": shorten(exc, 300)})
        return json_reply(200, {"scores": scores})

    async def health(request: Request) -> Response:  # noqa: ARG001 - starlette's signature
        return json_reply(200, {"ok": True})

    async def not_found(request: Request, exc: Exception) -> Response:  # noqa: ARG001
        return json_reply(404, {"error": f"no such path {shorten(request.url.path)}"})

    async def not_allowed(request: Request, exc: Exception) -> Response:  # noqa: ARG001
        return json_reply(405, {"error": f"{request.method} not allowed on {shorten(request.url.path)}"})

    return Starlette(
        routes=[Route("/score", score_endpoint, methods=["POST"]), Route("/health", health, methods=["GET"])],
        exception_handlers={404: not_found, 405: not_allowed},
    )


def _protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol plus a deadline for each request's line and headers, counted from
    the connection (or the previous response): uvicorn itself only times out idle keep-alive
    connections, so a client sending one header byte a minute would hold a connection forever."""

    class HeaderDeadlineH11(H11Protocol):
        def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's signature
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._previous_cycle = self.cycle  # headers arrived once a new cycle exists
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._previous_cycle:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._disarm()
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineH11


def make_server(fn: RuleFn, limits: ServerLimits = ServerLimits()) -> uvicorn.Server:
    """A uvicorn server for ``make_app(fn)``; ``server.run(sockets=[bind(host, port)])`` serves."""
    config = uvicorn.Config(
        make_app(fn, limits),
        http=_protocol(limits.header_timeout_s),
        backlog=limits.backlog,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    return uvicorn.Server(config)


def bind(host: str, port: int, backlog: int = ServerLimits.backlog) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0 = any free port): connections queue from now
    on, before the server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def serve(rule: str, host: str, port: int, max_request_bytes: int) -> None:
    """``hybridflow serve-reward``: serve ``rule`` until interrupted."""
    limits = ServerLimits(max_request_bytes=max_request_bytes)
    sock = bind(host, port, limits.backlog)
    server = make_server(load_rule(rule), limits)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"serve-reward: {rule} on http://{bound_host}:{bound_port}", flush=True)
    server.run(sockets=[sock])
