"""The simulator's HTTP face: a Starlette app speaking SGLang's wire format, served by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from types import TracebackType
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from eaglegen.sim import metrics
from eaglegen.sim.config import FaultConfig, SimConfig
from eaglegen.sim.connection import DroppableH11Protocol, drop
from eaglegen.sim.faults import MALFORMED_BODY, Decision, Fault, error_body
from eaglegen.sim.protocol import (
    GenerateRequest,
    RequestError,
    parse_generate,
    response_body,
    stripped,
    validation_error_body,
    wants_stream,
)
from eaglegen.sim.scheduler import Job
from eaglegen.sim.service import SimService
from eaglegen.sim.streaming import (
    EventStream,
    StreamOptions,
    error_stream,
    queue_full_stream,
    stream_response,
)
from eaglegen.sim.voice import load_voice

logger = logging.getLogger(__name__)
SIM_VERSION = "0.1.0-eaglegen-sim"
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


def _service(request: Request) -> SimService:
    """The app's SimService."""
    service: SimService = request.app.state.sim
    return service


async def generate_endpoint(request: Request) -> Response:
    """POST /generate: one prompt or a batch, answered when the simulated model finishes, or
    streamed as it decodes."""
    service = _service(request)
    # Read the whole request first: a drop then hits a client waiting for its answer.
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client died mid-request (a killed worker)
        return Response(status_code=499)
    try:
        body: object = _json_body(raw)
    except RequestError as exc:
        body = exc
    stream = wants_stream(body)
    # Faults are decided before parsing and scheduling, so a faulted call costs no KV.
    decision = service.faults.decide(stream=stream)
    if decision.delay_s > 0:
        await asyncio.sleep(decision.delay_s)
    fault = decision.fault
    if fault is not None and fault.kind in ("drop", "malformed", "error"):
        return await _inject(fault, request, stream)
    if isinstance(body, RequestError):
        return _refuse(body, stream)
    return await _generate(service, body, request.receive, decision)


async def _inject(fault: Fault, request: Request, stream: bool) -> Response:
    """The answer to a faulted call, or the lack of one."""
    if fault.kind == "drop":
        return await drop(request)
    if fault.kind == "malformed":
        if stream:
            return EventStream(_malformed_events())
        return Response(MALFORMED_BODY, media_type="application/json")
    return JSONResponse(error_body(fault.status), status_code=fault.status)


async def _malformed_events() -> AsyncIterator[bytes]:
    """A stream whose one event is cut mid-JSON, and that ends without [DONE]."""
    yield b"data: " + MALFORMED_BODY + b"\n\n"


def _refuse(exc: RequestError, stream: bool) -> Response:
    """A refused request: FastAPI's 400s come before the stream starts, SGLang's own errors
    inside it."""
    if stream and not exc.validation:
        return error_stream(exc.message)
    return JSONResponse(exc.body(), status_code=400)


async def _generate(
    service: SimService, body: object, receive: Receive, decision: Decision
) -> Response:
    """Validate, schedule and answer one /generate call."""
    started = time.perf_counter()
    try:
        parsed = parse_generate(body, service.limits)
    except RequestError as exc:
        return _refuse(exc, wants_stream(body))
    if not service.alive():
        message = validation_error_body("The simulator is not running.", code=503, kind="503")
        return JSONResponse(message, status_code=503)
    if service.queue_full(len(parsed.items)):
        if parsed.stream:
            return queue_full_stream(parsed, started)
        message = validation_error_body("The request queue is full.", code=503, kind="503")
        return JSONResponse(message, status_code=503)
    jobs = [service.make_job(item, parsed.log_metrics) for item in parsed.items]
    if parsed.stream:
        return _stream(service, parsed, jobs, started, decision)
    if not await service.run(jobs, receive):
        return Response(status_code=499)  # nobody is listening any more
    result = _results(service, parsed, jobs, started, decision)
    if decision.fault is not None and decision.fault.kind == "drip":
        return _drip(result, service.faults.config)
    return JSONResponse(result)


def _stream(
    service: SimService,
    parsed: GenerateRequest,
    jobs: list[Job],
    started: float,
    decision: Decision,
) -> EventStream:
    """Queue jobs whose chunks go out as they decode."""
    cfg = service.config
    intervals = [item.stream_interval or cfg.stream_interval for item in parsed.items]
    stalled = decision.fault is not None and decision.fault.kind == "stall"
    options = StreamOptions(
        incremental=cfg.incremental_streaming_output,
        leak_prompt_tokens=decision.leak_prompt_tokens,
        strip=service.layout.special_ids() if decision.strip_special_tokens else frozenset(),
        stall_after=service.faults.config.stall_after_chunks if stalled else None,
    )
    watches = service.stream(jobs, intervals)
    return stream_response(service, parsed, watches, started, options)


def _drip(result: object, faults: FaultConfig) -> StreamingResponse:
    """A 200 whose JSON body trickles out a few bytes at a time (the drip fault)."""
    body = JSONResponse(result).body
    piece, pause = faults.drip_bytes, faults.drip_interval_ms / 1000.0

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), piece):
            if start:
                await asyncio.sleep(pause)
            yield bytes(body[start : start + piece])

    headers = {"content-length": str(len(body))}
    return StreamingResponse(pieces(), media_type="application/json", headers=headers)


def _json_body(raw: bytes) -> object:
    """The request body as JSON, or the validation error FastAPI would give."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"JSON decode error: {exc}", validation=True) from exc


def _results(
    service: SimService,
    parsed: GenerateRequest,
    jobs: list[Job],
    started: float,
    decision: Decision,
) -> dict[str, Any] | list[dict[str, Any]]:
    """Response bodies for finished jobs: a dict, or a list for a batch."""
    latency = time.perf_counter() - started
    specials = service.layout.special_ids()
    bodies = []
    for item, job in zip(parsed.items, jobs, strict=True):
        if parsed.log_metrics:
            service.e2e.observe(latency)
        completion = job.completion
        if decision.strip_special_tokens:
            completion = stripped(completion, specials)
        bodies.append(
            response_body(
                item,
                completion,
                text=service.text(completion, item),
                cached_tokens=job.cached_tokens,
                e2e_latency=latency,
                leak_prompt_tokens=decision.leak_prompt_tokens,
                retractions=job.retractions,
            )
        )
    stats = service.faults.stats
    if decision.leak_prompt_tokens:
        stats.leaked += len(bodies)
    if decision.strip_special_tokens:
        stats.stripped += len(bodies)
    stats.broken_tool_args += sum(job.completion.broken_tool_args for job in jobs)
    return bodies if parsed.is_batch else bodies[0]


async def health_endpoint(request: Request) -> Response:
    """GET /health and /health_generate: 200 while the step loop runs and no fault says down."""
    service = _service(request)
    healthy = service.alive() and service.faults.health_ok()
    return Response(status_code=200 if healthy else 503)


async def model_info_endpoint(request: Request) -> Response:
    """GET /get_model_info with SGLang's keys."""
    service = _service(request)
    return JSONResponse(
        {
            "model_path": service.config.model_path,
            "tokenizer_path": str(service.config.tokenizer_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


async def server_info_endpoint(request: Request) -> Response:
    """GET /get_server_info: server args, scheduler info, internal states and version."""
    service = _service(request)
    cfg = service.config
    return JSONResponse(
        {
            **_server_args(cfg, request.url.port),
            "status": "ready",
            "max_total_num_tokens": cfg.kv_tokens,
            "max_req_input_len": min(cfg.context_length - 1, cfg.kv_tokens - 1) - 5,
            "internal_states": [_internal_state(service)],
            "version": SIM_VERSION,
            "simulator": _sim_knobs(service),
        }
    )


def _server_args(cfg: SimConfig, port: int | None) -> dict[str, Any]:
    """The subset of SGLang's ServerArgs that describes what the simulator imitates."""
    return {
        "model_path": cfg.model_path,
        "tokenizer_path": str(cfg.tokenizer_path),
        "served_model_name": cfg.model_path,
        "host": cfg.host,
        "port": port if port is not None else cfg.port,
        "context_length": cfg.context_length,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "max_total_tokens": cfg.kv_tokens,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "schedule_policy": "fcfs",
        "schedule_conservativeness": 1.0,
        "page_size": 1,
        "disable_radix_cache": False,
        "random_seed": cfg.seed,
        "skip_tokenizer_init": False,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "enable_metrics": True,
        "stream_interval": cfg.stream_interval,
        "incremental_streaming_output": cfg.incremental_streaming_output,
    }


def _internal_state(service: SimService) -> dict[str, Any]:
    """One DP rank's internal state, as in SGLang's get_internal_state."""
    return {
        "last_gen_throughput": service.meter.rate(time.monotonic()),
        "num_running_reqs": service.scheduler.num_running,
        "num_queue_reqs": service.scheduler.num_waiting,
        "token_usage": service.scheduler.token_usage,
        "new_token_ratio": service.scheduler.ratio.current,
    }


def _sim_knobs(service: SimService) -> dict[str, Any]:
    """The simulator's own settings (not an SGLang key), for benchmarks and debugging."""
    knobs = asdict(service.config)
    knobs["tokenizer_dir"] = str(service.config.tokenizer_path)
    knobs["family"] = service.voice.family  # the one detected, unless --family named it
    # The faults in force now, which POST /sim/faults may have changed since startup.
    knobs["faults"] = service.faults.config.to_json()
    return knobs


async def metrics_endpoint(request: Request) -> Response:
    """GET /metrics in Prometheus text format."""
    service = _service(request)
    queue_time = service.scheduler.queue_time
    text = metrics.render(service.snapshot(), service.e2e, service.config.model_path, queue_time)
    return Response(text, media_type=metrics.CONTENT_TYPE)


async def flush_cache_endpoint(request: Request) -> Response:
    """POST /flush_cache: refused with 400 while requests run or wait, like SGLang."""
    service = _service(request)
    if not service.scheduler.flush_cache():
        return PlainTextResponse(_FLUSH_TEXT, status_code=400)
    return PlainTextResponse(_FLUSH_TEXT)


async def faults_endpoint(request: Request) -> Response:
    """GET /sim/faults: the active faults; POST replaces them all (absent fields are off)."""
    service = _service(request)
    if request.method == "POST":
        try:
            faults = FaultConfig.from_json(json.loads(await request.body()))
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        service.faults.replace(faults)
    return JSONResponse(service.faults.config.to_json())


async def stats_endpoint(request: Request) -> Response:
    """GET /sim/stats: faults injected per kind since startup, and the scheduler's own counters
    (simulated time, retractions and the work they wasted)."""
    service = _service(request)
    return JSONResponse({**service.faults.stats.to_json(), "scheduler": service.scheduler_stats()})


def create_app(config: SimConfig) -> Starlette:
    """The simulator as an ASGI app; the step loop starts at startup.

    The tokenizer folder is read here, not inside uvicorn's lifespan where the cause of a
    failure would be swallowed: what cannot be served raises FileNotFoundError or ValueError,
    one line naming the folder; what deserves a warning (a family it does not know) is logged.
    """
    voice = load_voice(config.tokenizer_path, config.family)
    if voice.warning is not None:
        logger.warning("%s", voice.warning)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service = SimService(config, voice)
        app.state.sim = service
        service.start()
        try:
            yield
        finally:
            await service.stop()

    routes = [
        Route("/generate", generate_endpoint, methods=["POST", "PUT"]),
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/health_generate", health_endpoint, methods=["GET"]),
        Route("/get_model_info", model_info_endpoint, methods=["GET"]),
        Route("/get_server_info", server_info_endpoint, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/flush_cache", flush_cache_endpoint, methods=["GET", "POST"]),
        # The simulator's own controls, under a prefix SGLang does not use.
        Route("/sim/faults", faults_endpoint, methods=["GET", "POST"]),
        Route("/sim/stats", stats_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _uvicorn_config(config: SimConfig) -> uvicorn.Config:
    """uvicorn settings that hold thousands of open requests and can drop a connection."""
    return uvicorn.Config(
        create_app(config),
        http=DroppableH11Protocol,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        backlog=4096,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=3,
    )


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # An explicit IPPROTO_TCP makes asyncio set TCP_NODELAY on accepted sockets; with proto 0 it
    # does not, and Nagle holds each response body ~40 ms behind its separately written head.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def _url(host: str, port: int) -> str:
    """Base URL of a bound server."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(config: SimConfig, on_ready: Callable[[str], None] | None = None) -> None:
    """Run the simulator in the foreground until interrupted (`eaglegen sim`)."""
    server = uvicorn.Server(_uvicorn_config(config))
    sock = _bind(config.host, config.port)
    url = _url(config.host, sock.getsockname()[1])
    asyncio.run(_serve_and_announce(server, sock, url, on_ready))


async def _serve_and_announce(
    server: uvicorn.Server,
    sock: socket.socket,
    url: str,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve, calling on_ready(url) once the server accepts requests."""
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started and on_ready is not None:
            on_ready(url)
        await serving
    finally:
        await _close_connections(server)


async def _close_connections(server: uvicorn.Server) -> None:
    """Abort the connections uvicorn's shutdown left open (those whose request it cancelled
    after its grace period), while the loop still runs: a transport still open when the loop
    closes is closed only by the garbage collector, later, with a ResourceWarning."""
    for connection in list(server.server_state.connections):
        transport = getattr(connection, "transport", None)
        if transport is not None:
            transport.abort()  # also one closing with unsent bytes: close() waits for a reader
    await asyncio.sleep(0)  # one loop turn: each abort's connection_lost runs and closes


class SimServer:
    """Context manager running the simulator on a loopback port in a background thread."""

    def __init__(self, config: SimConfig | None = None, startup_timeout: float = 20.0) -> None:
        """Prepare, do not start."""
        self.config = config or SimConfig()
        self.startup_timeout = startup_timeout
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> SimServer:
        """Start serving and return once /health answers 200."""
        self._server = uvicorn.Server(_uvicorn_config(self.config))
        sock = _bind(self.config.host, self.config.port)
        self.url = _url(self.config.host, sock.getsockname()[1])
        self._thread = threading.Thread(
            target=self._serve, args=(self._server, sock), name="eaglegen-sim", daemon=True
        )
        self._thread.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _serve(self, server: uvicorn.Server, sock: socket.socket) -> None:
        """Thread body: run uvicorn, keeping any crash for the starting thread."""
        try:
            asyncio.run(_serve_and_announce(server, sock, self.url))
        except BaseException as exc:  # reported by _wait_healthy
            self._error = exc
        finally:
            sock.close()

    def _wait_healthy(self) -> None:
        """Poll /health until it answers 200, the thread dies or the timeout passes."""
        deadline = time.monotonic() + self.startup_timeout
        # A server started unhealthy on purpose never passes /health; any answer means it is up.
        probe = "/sim/faults" if self.config.faults.unhealthy else "/health"
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError("simulator failed to start") from self._error
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}{probe}").status_code == 200:
                        return
                time.sleep(0.02)
        raise TimeoutError(f"simulator did not answer /health within {self.startup_timeout}s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop uvicorn and wait for the thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
