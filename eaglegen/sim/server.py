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
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive
from tokenizers import Tokenizer

from eaglegen.sim import metrics
from eaglegen.sim.config import FaultConfig, SimConfig
from eaglegen.sim.connection import DroppableH11Protocol, drop
from eaglegen.sim.engine import (
    Completion,
    Job,
    OutputShape,
    PrefixCache,
    Scheduler,
    ThroughputMeter,
    Vocab,
    decode_seconds,
    generate,
    prefill_seconds,
)
from eaglegen.sim.faults import MALFORMED_BODY, Fault, FaultInjector, error_body
from eaglegen.sim.protocol import (
    GenerateItem,
    GenerateRequest,
    Limits,
    RequestError,
    ids_for_text,
    parse_generate,
    response_body,
    validation_error_body,
)
from eaglegen.sim.vocab import load_vocab

SIM_VERSION = "0.1.0-eaglegen-sim"
logger = logging.getLogger(__name__)
# Falling further behind than this re-anchors the step clock instead of bursting to catch up.
_MAX_LAG_S = 0.05
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


class _StepClock:
    """Paces simulated steps against wall time, absorbing the loop's own processing time."""

    def __init__(self) -> None:
        """Anchor at now."""
        self._t = time.monotonic()

    def reset(self) -> None:
        """Re-anchor after an idle period."""
        self._t = time.monotonic()

    async def advance(self, seconds: float) -> None:
        """Sleep until this step's simulated end."""
        self._t += seconds
        delay = self._t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
            return
        if -delay > _MAX_LAG_S:
            self._t = time.monotonic()
        # Yield anyway so HTTP handlers run between back-to-back steps.
        await asyncio.sleep(0)


class SimService:
    """Runtime state of one simulator: scheduler, tokenizer and the single step-driving task."""

    def __init__(self, config: SimConfig, vocab: Vocab, tokenizer: Tokenizer) -> None:
        """Build the engine; nothing runs until start()."""
        self.config = config
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.shape = OutputShape(config.mean_output_tokens, config.max_output_tokens)
        self.limits = Limits(vocab.vocab_size, config.context_length, config.kv_tokens, config.seed)
        self.scheduler = Scheduler(
            config.kv_tokens,
            config.max_running_requests,
            config.max_prefill_tokens,
            PrefixCache(config.kv_tokens),
        )
        self.meter = ThroughputMeter()
        self.e2e = metrics.Histogram()
        self.faults = FaultInjector(config.faults)
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-steps")

    async def stop(self) -> None:
        """Stop the step loop and fail whatever still waits."""
        if self._task is not None:
            self._task.cancel()
            # A crash was already logged by _run; shutdown must not raise it again.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for future in self._futures.values():
            future.cancel()

    def alive(self) -> bool:
        """Whether the step loop runs."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        """Drive the steps; a crash fails every waiting request and marks the server unhealthy."""
        try:
            await self._steps()
        except Exception as exc:
            logger.exception("simulator step loop crashed")
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"simulator step loop crashed: {exc}"))
            raise

    async def _steps(self) -> None:
        """The one task that drives every request: admit, prefill, decode, repeat."""
        clock = _StepClock()
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                clock.reset()
                continue
            await self._one_round(clock)

    async def _one_round(self, clock: _StepClock) -> None:
        """One prefill batch (if any job fits) followed by one decode step."""
        batch = self.scheduler.admit()
        if batch is not None:
            await clock.advance(
                prefill_seconds(batch.extend_tokens, self.config.prefill_tokens_per_ms)
            )
            self._resolve(self.scheduler.finish_prefill(batch))
        running = self.scheduler.num_decoding
        if running:
            cfg = self.config
            await clock.advance(
                decode_seconds(running, cfg.decode_step_ms, cfg.decode_ms_per_request)
            )
            self._resolve(self.scheduler.decode_step())
            self.meter.record(time.monotonic(), self.scheduler.tokens_generated)
        elif batch is None:
            # Defensive: work exists yet nothing can move; never spin.
            await asyncio.sleep(0.001)

    def _resolve(self, jobs: list[Job]) -> None:
        """Wake the handlers of finished jobs."""
        for job in jobs:
            future = self._futures.pop(job.key, None)
            if future is not None and not future.done():
                future.set_result(None)

    def queue_full(self, incoming: int) -> bool:
        """Whether accepting more requests would overflow --max-queued-requests."""
        cap = self.config.max_queued_requests
        return cap is not None and self.scheduler.num_waiting + incoming > cap

    def make_job(self, item: GenerateItem, count_in_metrics: bool) -> Job:
        """Generate an item's output now; the scheduler decides when it is revealed."""
        completion = generate(item.input_ids, item.sampling, self.vocab, self.shape)
        return Job(item.input_ids, completion, item.reserve, count_in_metrics)

    async def run(self, jobs: list[Job], receive: Receive) -> bool:
        """Run jobs to completion; False (and the jobs aborted) if the client disconnects."""
        futures = [self._submit(job) for job in jobs]
        done_all: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*futures))
        gone: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({done_all, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if done_all.done():
            done_all.result()
            return True
        done_all.cancel()
        for job in jobs:
            self._futures.pop(job.key, None)
            self.scheduler.abort(job)
        return False

    def _submit(self, job: Job) -> asyncio.Future[None]:
        """Queue one job and wake the step loop."""
        self.scheduler.submit(job)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[job.key] = future
        self._wake.set()
        return future

    def text(self, completion: Completion, item: GenerateItem) -> str:
        """Detokenize like SGLang's detokenizer manager."""
        ids = ids_for_text(completion, item.text_options)
        return str(
            self.tokenizer.decode(ids, skip_special_tokens=item.text_options.skip_special_tokens)
        )

    def snapshot(self) -> metrics.Snapshot:
        """Current values for /metrics."""
        s = self.scheduler
        return metrics.Snapshot(
            num_running_reqs=s.num_running,
            num_queue_reqs=s.num_waiting,
            num_used_tokens=s.used_tokens,
            token_usage=s.used_tokens / s.kv_tokens,
            gen_throughput=self.meter.rate(time.monotonic()),
            cache_hit_rate=s.last_cache_hit_rate,
            max_total_num_tokens=s.kv_tokens,
            prompt_tokens_total=s.totals.prompt_tokens,
            generation_tokens_total=s.totals.generation_tokens,
            cached_tokens_total=s.totals.cached_tokens,
            num_requests_total=s.totals.requests,
        )


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client closes the connection (the body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _service(request: Request) -> SimService:
    """The app's SimService."""
    service: SimService = request.app.state.sim
    return service


async def generate_endpoint(request: Request) -> Response:
    """POST /generate: one prompt or a batch, answered when the simulated model finishes."""
    service = _service(request)
    # Read the whole request first: a drop then hits a client waiting for its answer.
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client died mid-request (a killed worker)
        return Response(status_code=499)
    # Faults are decided before parsing and scheduling, so a faulted call costs no KV.
    decision = service.faults.decide()
    if decision.delay_s > 0:
        await asyncio.sleep(decision.delay_s)
    if decision.fault is not None:
        return await _inject(decision.fault, request)
    return await _generate(service, raw, request.receive, leak=decision.leak_prompt_tokens)


async def _inject(fault: Fault, request: Request) -> Response:
    """The answer to a faulted call, or the lack of one."""
    if fault.kind == "drop":
        return await drop(request)
    if fault.kind == "malformed":
        return Response(MALFORMED_BODY, media_type="application/json")
    return JSONResponse(error_body(fault.status), status_code=fault.status)


async def _generate(service: SimService, raw: bytes, receive: Receive, *, leak: bool) -> Response:
    """Validate, schedule and answer one /generate call."""
    started = time.perf_counter()
    try:
        parsed = parse_generate(_json_body(raw), service.limits)
    except RequestError as exc:
        return JSONResponse(exc.body(), status_code=400)
    if not service.alive():
        body = validation_error_body("The simulator is not running.", code=503, kind="503")
        return JSONResponse(body, status_code=503)
    if service.queue_full(len(parsed.items)):
        body = validation_error_body("The request queue is full.", code=503, kind="503")
        return JSONResponse(body, status_code=503)
    jobs = [service.make_job(item, parsed.log_metrics) for item in parsed.items]
    if not await service.run(jobs, receive):
        return Response(status_code=499)  # nobody is listening any more
    return JSONResponse(_results(service, parsed, jobs, started, leak))


def _json_body(raw: bytes) -> object:
    """The request body as JSON, or the validation error FastAPI would give."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"JSON decode error: {exc}", validation=True) from exc


def _results(
    service: SimService, parsed: GenerateRequest, jobs: list[Job], started: float, leak: bool
) -> dict[str, Any] | list[dict[str, Any]]:
    """Response bodies for finished jobs: a dict, or a list for a batch."""
    latency = time.perf_counter() - started
    bodies = []
    for item, job in zip(parsed.items, jobs, strict=True):
        if parsed.log_metrics:
            service.e2e.observe(latency)
        text = service.text(job.completion, item)
        bodies.append(
            response_body(
                item,
                job.completion,
                text=text,
                cached_tokens=job.cached_tokens,
                e2e_latency=latency,
                leak_prompt_tokens=leak,
            )
        )
    if leak:
        service.faults.stats.leaked += len(bodies)
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
        "schedule_policy": "fcfs",
        "schedule_conservativeness": 1.0,
        "page_size": 1,
        "disable_radix_cache": False,
        "random_seed": cfg.seed,
        "skip_tokenizer_init": False,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "enable_metrics": True,
        "stream_output": False,
    }


def _internal_state(service: SimService) -> dict[str, Any]:
    """One DP rank's internal state, as in SGLang's get_internal_state."""
    return {
        "last_gen_throughput": service.meter.rate(time.monotonic()),
        "num_running_reqs": service.scheduler.num_running,
        "num_queue_reqs": service.scheduler.num_waiting,
        "token_usage": service.scheduler.used_tokens / service.scheduler.kv_tokens,
    }


def _sim_knobs(service: SimService) -> dict[str, Any]:
    """The simulator's own settings (not an SGLang key), for benchmarks and debugging."""
    knobs = asdict(service.config)
    knobs["tokenizer_dir"] = str(service.config.tokenizer_path)
    # The faults in force now, which POST /sim/faults may have changed since startup.
    knobs["faults"] = service.faults.config.to_json()
    return knobs


async def metrics_endpoint(request: Request) -> Response:
    """GET /metrics in Prometheus text format."""
    service = _service(request)
    text = metrics.render(service.snapshot(), service.e2e, service.config.model_path)
    return Response(text, media_type=metrics.CONTENT_TYPE)


async def flush_cache_endpoint(request: Request) -> Response:
    """POST /flush_cache: refused with 400 while requests run or wait, like SGLang."""
    service = _service(request)
    if service.scheduler.has_work():
        return PlainTextResponse(_FLUSH_TEXT, status_code=400)
    service.scheduler.cache.clear()
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
    """GET /sim/stats: faults injected per kind since startup."""
    return JSONResponse(_service(request).faults.stats.to_json())


def create_app(config: SimConfig) -> Starlette:
    """The simulator as an ASGI app; the tokenizer loads and the step loop starts at startup."""
    tokenizer_json = config.tokenizer_path / "tokenizer.json"
    if not tokenizer_json.is_file():
        # Fail here, not inside uvicorn's lifespan where the cause would be swallowed.
        raise FileNotFoundError(f"no tokenizer at {tokenizer_json}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        vocab, tokenizer = load_vocab(config.tokenizer_path)
        service = SimService(config, vocab, tokenizer)
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
    if on_ready is not None:
        asyncio.run(_serve_and_announce(server, sock, url, on_ready))
    else:
        server.run(sockets=[sock])


async def _serve_and_announce(
    server: uvicorn.Server, sock: socket.socket, url: str, on_ready: Callable[[str], None]
) -> None:
    """Serve, calling on_ready(url) once the server accepts requests."""
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_ready(url)
    await serving


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
            server.run(sockets=[sock])
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
