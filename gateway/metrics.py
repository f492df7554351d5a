"""Prometheus metrics (prometheus_client) and the per-request access record.

Two kinds of metric (names listed in the README, "Prometheus metrics"):

* event metrics, updated once per finished request by the middleware: requests by endpoint,
  model and status; end-to-end latency, time to first token and queue wait histograms
  (seconds); prompt and generated tokens; and requests aiohttp's HTTP parser refused
  (``unparsed``, counted by ``gateway.logs.ServerLogger``: no gateway code sees them);
* live metrics, read at scrape time by :class:`LiveCollector` from the gateway's own state:
  queue depth by priority, in-flight requests, per worker slots busy/total, KV fill,
  deferred requests, tokens/s, relative speed and per-sequence decode rate (``gateway.speed``),
  restarts and state, and per GPU utilisation, memory, temperature and power through NVML
  (``workers.gpu.read_gpu_stats``; nothing without a GPU).

Handlers report what only they know through the aiohttp request mapping, with
:func:`note_lease` (worker, model, priority, queue wait) and :func:`note_first_byte` (TTFT),
plus ``request["eval_count"]`` / ``request["prompt_eval_count"]`` (tokens; :func:`note_usage`
for an OpenAI ``usage`` object).
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers.gpu import GpuStats, read_gpu_stats

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.app import Gateway

PREFIX = "llama_gateway"
WORKER_STATES = ("starting", "ready", "draining", "backoff", "wedged", "failed", "stopped")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def note_lease(request: "web.Request", lease) -> None:
    """Record on ``request`` which worker serves it and how long it queued (ms, every attempt
    of a retried request: ``Ticket.queue_wait_s``)."""
    t = lease.ticket
    request["worker"] = lease.worker.id
    request["model"] = t.model
    request["priority"] = t.priority
    request["queue_wait_ms"] = round(t.queue_wait_s(lease.granted_at) * 1000, 3)


def note_first_byte(request: "web.Request") -> None:
    """Record time to first token (ms since the gateway received the request), once."""
    if "ttft_ms" not in request:
        request["ttft_ms"] = round((time.monotonic_ns() - request.get("t0_ns", 0)) / 1e6, 3)


def note_usage(request: "web.Request", usage: dict | None) -> None:
    """Record an OpenAI ``usage`` object's ``prompt_tokens`` / ``completion_tokens`` (tokens) on
    ``request``; None counts as an empty usage (both unknown)."""
    usage = usage or {}
    request["prompt_eval_count"] = usage.get("prompt_tokens")
    request["eval_count"] = usage.get("completion_tokens")


def note_openai_usage(request: "web.Request", body: bytes) -> None:
    """Pick ``usage.prompt_tokens`` / ``completion_tokens`` out of a /v1 body or SSE chunk
    (bytes as the worker sent them; see :func:`note_usage` for an already parsed one)."""
    if b'"usage"' not in body:
        return
    import orjson
    for part in body.split(b"\n"):
        part = part.strip()
        if part.startswith(b"data:"):
            part = part[5:].strip()
        if b'"usage"' not in part:
            continue
        try:
            usage = orjson.loads(part).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        note_usage(request, usage)


def endpoint_label(request: "web.Request") -> str:
    """The matched route's path template (bounded label set); ``other`` when none matched."""
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    if resource is None or getattr(info, "http_exception", None) is not None:
        return "other"
    return resource.canonical


class RecentErrors:
    """The last ``n`` errors for the status page: dicts {time (unix s), source, message}."""

    def __init__(self, n: int = 20):
        self.items: collections.deque = collections.deque(maxlen=n)

    def add(self, source: str, message: str) -> None:
        self.items.append({"time": time.time(), "source": source, "message": message[:300]})

    def list(self) -> list[dict]:
        return list(reversed(self.items))


class GatewayMetrics:
    """One registry per gateway (no global state, so tests may run several)."""

    def __init__(self, gw: "Gateway", gpu_stats: Callable[[], dict[int, GpuStats]] = read_gpu_stats):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "Finished HTTP requests",
                                ["endpoint", "model", "status"], registry=r)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds",
                                 "End-to-end request time, received to last byte (s)",
                                 ["endpoint", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Received to first byte from the worker (s)", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds",
                                    "Time a request waited for a slot (s)", ["model"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_in = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens evaluated", ["model"],
                                 registry=r)
        self.tokens_out = Counter(f"{PREFIX}_generated_tokens", "Tokens generated", ["model"],
                                  registry=r)
        self.cut = Counter(f"{PREFIX}_answers_cut", "Answers that began with 200 and ended "
                           "with an error line or event (worker failed, stalled, shutdown)",
                           ["endpoint", "model"], registry=r)
        self.reloads = Counter(f"{PREFIX}_config_reloads", "Config reloads by result", ["result"],
                               registry=r)
        self.unparsed = Counter(f"{PREFIX}_requests_unparsed",
                                "Requests aiohttp's HTTP parser refused (its text/plain 400)",
                                registry=r)
        r.register(LiveCollector(gw, gpu_stats))
        self.errors = RecentErrors()

    def observe(self, request: "web.Request", status: int, duration_s: float) -> None:
        """Count one finished request. Its ``model`` label is ``request["model"]``: a configured
        model's full name (set by the guard middleware once the body names one, refused requests
        included, and by :func:`note_lease`), else "" (no model, or a name not configured), so
        the label set stays bounded by the config."""
        ep = endpoint_label(request)
        model = request.get("model") or ""
        self.requests.labels(ep, model, str(status)).inc()
        self.latency.labels(ep, model).observe(duration_s)
        if request.get("ttft_ms") is not None:
            self.ttft.labels(model).observe(request["ttft_ms"] / 1000)
        if request.get("queue_wait_ms") is not None:
            self.queue_wait.labels(model).observe(request["queue_wait_ms"] / 1000)
        if isinstance(request.get("prompt_eval_count"), int):
            self.tokens_in.labels(model).inc(request["prompt_eval_count"])
        if isinstance(request.get("eval_count"), int):
            self.tokens_out.labels(model).inc(request["eval_count"])
        elif request.get("events_streamed"):
            # ended before the worker's own count (client left, worker failed, shutdown):
            # the answer's SSE events read from the worker, about one per generated token
            self.tokens_out.labels(model).inc(request["events_streamed"])
        if status < 400 and request.get("error"):  # the 200 began, an error line ended it
            self.cut.labels(ep, model).inc()
        if status >= 500:
            self.errors.add(ep, f"{status} {request.method} {request.path}"
                                + (f" ({request['error']})" if request.get("error") else ""))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def worker_state(gw: "Gateway", sup) -> str:
    """Supervisor state, shown as ``draining`` while a ready worker is out of rotation."""
    if sup.state == "ready" and gw.fleet is not None and gw.fleet.draining(sup.id):
        return "draining"
    return sup.state


class LiveCollector:
    """Reads the gateway's live state at scrape time (prometheus_client custom collector)."""

    def __init__(self, gw: "Gateway", gpu_stats: Callable[[], dict[int, GpuStats]]):
        self.gw = gw
        self.gpu_stats = gpu_stats

    def describe(self):
        return []

    def collect(self):
        gw = self.gw
        disp = gw.dispatcher
        q = GaugeMetricFamily(f"{PREFIX}_queue_depth", "Requests waiting for a slot", labels=["priority"])
        depth = disp.queue.depth_by_priority()
        for prio in sorted(set(depth) | {m.priority for m in gw.config.models}):
            q.add_metric([str(prio)], depth.get(prio, 0))
        yield q
        yield GaugeMetricFamily(f"{PREFIX}_queue_max_pending", "Queue bound (queue.max_pending)",
                                value=disp.max_pending)
        yield GaugeMetricFamily(f"{PREFIX}_in_flight_requests",
                                "Inference requests being handled (queued or running); model "
                                "lists, status, admin and this scrape are not counted",
                                value=gw.inference_in_flight)
        labels = ["worker", "model", "gpu"]
        busy = GaugeMetricFamily(f"{PREFIX}_worker_slots_busy", "Slots held by requests", labels=labels)
        total = GaugeMetricFamily(f"{PREFIX}_worker_slots", "Slots (-np) of the worker", labels=labels)
        prefill = GaugeMetricFamily(f"{PREFIX}_worker_prefill_backlog_tokens",
                                    "Estimated prompt tokens of the worker's requests that have "
                                    "no first token yet", labels=labels)
        kv = GaugeMetricFamily(f"{PREFIX}_worker_kv_fill_ratio",
                               "KV cache fill 0..1 (from /slots; absent when unknown)", labels=labels)
        deferred = GaugeMetricFamily(f"{PREFIX}_worker_requests_deferred",
                                     "llama-server llamacpp:requests_deferred", labels=labels)
        tps = GaugeMetricFamily(f"{PREFIX}_worker_tokens_per_second",
                                "Generated tokens/s over the last poll interval", labels=labels)
        speed = GaugeMetricFamily(f"{PREFIX}_worker_speed_ratio",
                                  "Relative decode speed the scheduler uses (1 = the model's "
                                  "reference worker, or unmeasured)", labels=labels)
        seq_tps = GaugeMetricFamily(f"{PREFIX}_worker_sequence_tokens_per_second",
                                    "Measured decode rate of one sequence (absent while unmeasured)",
                                    labels=labels)
        restarts = CounterMetricFamily(
            f"{PREFIX}_worker_restarts",
            "Worker restarts: crash, failed start, wedge, admin or reload restart, leaked slot",
            labels=labels)
        crashes = CounterMetricFamily(
            f"{PREFIX}_worker_crashes",
            "Worker runs that ended without the gateway stopping them: exits, kills, wedges, "
            "failed starts", labels=labels)
        up = GaugeMetricFamily(f"{PREFIX}_worker_up", "1 when the worker is ready and in rotation",
                               labels=labels)
        state = GaugeMetricFamily(f"{PREFIX}_worker_state", "1 for the worker's current state",
                                  labels=labels + ["state"])
        sups = list(gw.fleet.supervisors.values()) if gw.fleet else []
        for sup in sups:
            lv = [sup.id, sup.spec.alias, sup.spec.gpu_label]
            view = disp.workers.get(sup.id)
            st = worker_state(gw, sup)
            busy.add_metric(lv, view.busy if view else 0)
            total.add_metric(lv, view.slots if view else sup.spec.slots)
            prefill.add_metric(lv, view.prefill_backlog if view else 0)
            ws = gw.worker_stats.get(sup.id)
            if ws.kv_fill is not None:
                kv.add_metric(lv, ws.kv_fill)
            if ws.deferred is not None:
                deferred.add_metric(lv, ws.deferred)
            if ws.tokens_per_s is not None:
                tps.add_metric(lv, ws.tokens_per_s)
            speed.add_metric(lv, view.speed if view else 1.0)
            rate = gw.fleet.speeds.rate(sup.id)
            if rate is not None:
                seq_tps.add_metric(lv, rate)
            restarts.add_metric(lv, sup.restarts)
            crashes.add_metric(lv, sup.crashes)
            up.add_metric(lv, 1 if st == "ready" else 0)
            for s in WORKER_STATES:
                state.add_metric(lv + [s], 1 if st == s else 0)
        yield from (busy, total, prefill, kv, deferred, tps, speed, seq_tps, restarts, crashes,
                    up, state)
        gl = ["gpu", "name"]
        util = GaugeMetricFamily(f"{PREFIX}_gpu_utilization_percent", "NVML GPU utilisation (%)", labels=gl)
        mem = GaugeMetricFamily(f"{PREFIX}_gpu_memory_used_bytes", "NVML memory used (bytes)", labels=gl)
        memt = GaugeMetricFamily(f"{PREFIX}_gpu_memory_total_bytes", "NVML memory total (bytes)", labels=gl)
        temp = GaugeMetricFamily(f"{PREFIX}_gpu_temperature_celsius", "NVML GPU temperature (°C)", labels=gl)
        power = GaugeMetricFamily(f"{PREFIX}_gpu_power_watts", "NVML power draw (W)", labels=gl)
        for g in self.gpu_stats().values():
            lv = [str(g.index), g.name]
            util.add_metric(lv, g.util_percent)
            mem.add_metric(lv, g.memory_used_bytes)
            memt.add_metric(lv, g.memory_total_bytes)
            temp.add_metric(lv, g.temperature_c)
            power.add_metric(lv, g.power_w)
        yield from (util, mem, memt, temp, power)
