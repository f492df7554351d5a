"""Gateway configuration: YAML -> validated, frozen, typed settings (pydantic v2).

Entry points:

* :func:`load_config` reads a YAML file, :func:`parse_config` validates already-parsed data.
  Both return a frozen :class:`GatewayConfig` or raise :class:`ConfigError`, whose ``errors``
  name the key path, what was expected and what was got, e.g.::

      models[0].slots: expected a positive integer, got "four"
      models[0].slotz: unknown key (did you mean "slots"?)

* :func:`plan_workers` turns a config plus the detected GPU indices into one
  :class:`WorkerPlan` per llama-server process.
* :func:`diff_plans` compares two plans (for hot reload).

Units are in the key names: ``*_s`` are seconds, ``context`` is tokens per slot.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.functional_validators import PlainValidator

__all__ = [
    "BUILTIN_MODELS",
    "ConfigError",
    "GatewayConfig",
    "ApiKeyConfig",
    "AuthConfig",
    "GenerationConfig",
    "HttpConfig",
    "LimitsConfig",
    "LlamaServerConfig",
    "LogConfig",
    "ModelConfig",
    "PlanDiff",
    "QueueConfig",
    "ShutdownConfig",
    "AdminConfig",
    "TimeoutsConfig",
    "WorkerPlan",
    "diff_plans",
    "load_config",
    "normalize_model_name",
    "parse_config",
    "plan_workers",
]

#: Models the gateway can provide itself, addressed as ``path: "builtin:<name>"``.
BUILTIN_MODELS: tuple[str, ...] = ("demo",)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------


class ConfigError(Exception):
    """Invalid or unreadable configuration.

    Attributes:
        errors: one line per problem, each ``"<key path>: <what is wrong>"``
            (e.g. ``models[0].slots: expected a positive integer, got "four"``); problems that
            concern the whole file (missing file, YAML syntax) have no key path.
        source: the file name (or ``"<config>"``) that ``str(e)`` prefixes to every line.
    """

    def __init__(self, errors: list[str] | str, source: str = "<config>") -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        self.source: str = str(source)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(f"{self.source}: {err}" for err in self.errors)


Loc = tuple[Union[str, int], ...]


class _Invalid(ValueError):
    """Raised by our validators; carries (relative key path, message) pairs.

    Pydantic wraps a ValueError into a ``value_error`` whose ``ctx["error"]`` is this object,
    which lets the translator emit our exact messages at the right key paths.
    """

    def __init__(self, *items: tuple[Loc, str]) -> None:
        self.items: list[tuple[Loc, str]] = list(items)
        super().__init__("; ".join(msg for _, msg in self.items))


def _fail(msg: str, *loc: str | int) -> None:
    raise _Invalid((tuple(loc), msg))


def _got(value: object) -> str:
    """Render a received value JSON-style (strings quoted, None as null), shortened. A string
    that reads as a number is said to be text: YAML 1.1 (PyYAML) reads ``1e-3`` without a dot,
    or a quoted number, as a string."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    if isinstance(value, str):
        try:
            if not math.isfinite(float(value)):
                return text
        except ValueError:
            return text
        return (f"the text {text} (YAML reads a quoted number, and an exponent without a dot "
                f"such as 1e-3, as text: write the number unquoted, e.g. 10, 0.001 or 1.0e-3)")
    return text


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _line(loc: Loc, msg: str) -> str:
    where = _path(loc)
    return f"{where}: {msg}" if where else msg


# --------------------------------------------------------------------------------------
# Value validators (plain: we do all checking, strictly — bool is never an int)
# --------------------------------------------------------------------------------------


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _v_pos_int(v: object) -> int:
    if _is_int(v) and v > 0:
        return v
    raise _Invalid(((), f"expected a positive integer, got {_got(v)}"))


def _v_opt_pos_int(v: object) -> int | None:
    if v is None or (_is_int(v) and v > 0):
        return v
    raise _Invalid(((), f"expected a positive integer or null, got {_got(v)}"))


def _v_nonneg_int(v: object) -> int:
    if _is_int(v) and v >= 0:
        return v
    raise _Invalid(((), f"expected a non-negative integer, got {_got(v)}"))


def _v_int(v: object) -> int:
    if _is_int(v):
        return v
    raise _Invalid(((), f"expected an integer, got {_got(v)}"))


def _v_num_predict(v: object) -> int:
    if _is_int(v) and v >= -2:
        return v
    raise _Invalid(
        ((), f"expected an integer >= -2 (-1 or -2 = until the end of the text or of the "
             f"context), got {_got(v)}")
    )


def _v_pos_float(v: object) -> float:
    if _is_number(v) and v > 0:
        return float(v)
    raise _Invalid(((), f"expected a positive number, got {_got(v)}"))


#: The shortest polling interval (s) the config takes: below it the gateway polls each worker
#: without pause (``poll_interval_s: 1e-9`` passed check-config).
MIN_INTERVAL_S = 0.01


def _v_interval(v: object) -> float:
    if _is_number(v) and v >= MIN_INTERVAL_S:
        return float(v)
    raise _Invalid(((), f"expected a number of seconds of at least {MIN_INTERVAL_S} (10 ms), "
                        f"got {_got(v)}"))


def _v_bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    raise _Invalid(((), f"expected true or false, got {_got(v)}"))


def _v_opt_str(v: object) -> str | None:
    if v is None:
        return None
    if isinstance(v, str) and v.strip():
        return os.path.expanduser(v)
    raise _Invalid(((), f"expected a non-empty string or null, got {_got(v)}"))


def _v_opt_secret(v: object) -> str | None:
    if v is None:
        return None
    if isinstance(v, str) and v.strip():
        return v
    raise _Invalid(((), f"expected a non-empty string or null, got {_got(v) if not isinstance(v, str) else 'an empty string'}"))


def _v_str_list(v: object) -> list[str]:
    """A list of strings; numbers are accepted and converted (``[-c, 4096]`` in YAML)."""
    if not isinstance(v, (list, tuple)):
        raise _Invalid(((), f"expected a list of strings, got {_got(v)}"))
    out: list[str] = []
    errs: list[tuple[Loc, str]] = []
    for i, item in enumerate(v):
        if isinstance(item, str):
            out.append(item)
        elif _is_number(item):
            out.append(str(item))
        elif isinstance(item, bool):  # YAML 1.1 reads on/off/yes/no/true/false unquoted so
            errs.append(((i,), f"expected a string, got {_got(item)} (YAML reads an unquoted "
                               f"on, off, yes, no, true or false as a boolean: quote it, "
                               f"e.g. \"on\")"))
        else:
            errs.append(((i,), f"expected a string, got {_got(item)}"))
    if errs:
        raise _Invalid(*errs)
    return out


def _v_name_label(v: object) -> str:
    if isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}", v):
        return v
    raise _Invalid(((), f"expected a label of letters, digits, '.', '_', '@' or '-', got {_got(v)}"))


def _v_opt_int(v: object) -> int | None:
    if v is None or _is_int(v):
        return v
    raise _Invalid(((), f"expected an integer or null, got {_got(v)}"))


#: Priority classes (models, API keys, ``X-Priority``) lie within ± this many: the queue adds
#: waited seconds to a class as a float (``AdmissionQueue.effective_priority``), and a class
#: too large for a float broke the dispatcher for every request (a 4,000-digit
#: ``X-Priority``; a fresh tester's find).
PRIORITY_LIMIT = 1000


def _v_priority(v: object) -> int:
    """A priority class: an integer within ±:data:`PRIORITY_LIMIT`."""
    if _is_int(v) and -PRIORITY_LIMIT <= v <= PRIORITY_LIMIT:
        return v
    raise _Invalid(((), f"expected an integer from -{PRIORITY_LIMIT} to {PRIORITY_LIMIT}, "
                        f"got {_got(v)}"))


def _v_opt_priority(v: object) -> int | None:
    """A priority class, or null."""
    return None if v is None else _v_priority(v)


def _v_model_patterns(v: object) -> list[str]:
    if not isinstance(v, (list, tuple)) or not v:
        raise _Invalid(((), f'expected a non-empty list of model names or ["*"], got {_got(v)}'))
    errs = [((i,), f'expected a model name or "*", got {_got(x)}') for i, x in enumerate(v)
            if not (isinstance(x, str) and (x == "*" or _NAME_RE.fullmatch(x)))]
    if errs:
        raise _Invalid(*errs)
    return list(v)


def _v_at_least_one(v: object) -> float:
    if _is_number(v) and v >= 1:
        return float(v)
    raise _Invalid(((), f"expected a number >= 1, got {_got(v)}"))


def _v_nonneg_float(v: object) -> float:
    if _is_number(v) and v >= 0:
        return float(v)
    raise _Invalid(((), f"expected a number >= 0, got {_got(v)}"))


def _choice(*choices: str):
    options = ", ".join(f'"{c}"' for c in choices)

    def check(v: object) -> str:
        if isinstance(v, str) and v in choices:
            return v
        raise _Invalid(((), f"expected one of {options}, got {_got(v)}"))

    return check


_LISTEN_V6 = re.compile(r"\[([0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?)\]:(\d{1,5})")
_LISTEN_HOST = re.compile(r"([A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?):(\d{1,5})")


def _split_listen(v: object) -> tuple[str, int] | None:
    if not isinstance(v, str):
        return None
    m = _LISTEN_V6.fullmatch(v)
    if m:
        import ipaddress

        try:
            ipaddress.IPv6Address(m.group(1).split("%", 1)[0])
        except ValueError:
            return None
    else:
        m = _LISTEN_HOST.fullmatch(v)
        if not m:
            return None
    return m.group(1), int(m.group(2))


def _v_listen(v: object) -> str:
    parts = _split_listen(v)
    if parts is None:
        raise _Invalid(((), f'expected "host:port", got {_got(v)}'))
    if not 0 <= parts[1] <= 65535:
        raise _Invalid(((), f'expected "host:port" with a port from 0 to 65535, got {_got(v)}'))
    return v  # type: ignore[return-value]


_NAME_SEG = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE = re.compile(rf"{_NAME_SEG}(?:/{_NAME_SEG})*(?::[A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})?")
_NAME_HINT = 'a model name like "demo", "demo:latest" or "ns/demo:7b"'


#: The host and namespace Ollama puts before a short name (types/model/name.go: ``demo`` is
#: ``registry.ollama.ai/library/demo:latest``, ``org/demo`` is ``registry.ollama.ai/org/demo``),
#: so clients that send the long form reach it.
_DEFAULT_HOST, _DEFAULT_NAMESPACE = "registry.ollama.ai/", "library/"


#: llama-server reads its integer arguments (``-c``, ``-np``) as a C ``int``.
INT32_MAX = 2**31 - 1
#: llama.cpp's most sequences per context (src/llama-cparams.h ``LLAMA_MAX_SEQ``): a worker
#: with more slots exits at start (``n_seq_max must be <= 256``).
MAX_SLOTS = 256


def normalize_model_name(name: str) -> str:
    """Canonical lookup key of an Ollama model name: ``":latest"`` appended when untagged,
    lower-cased (Ollama's ``strings.EqualFold``), without Ollama's default host and namespace
    ("Demo", "library/demo" and "registry.ollama.ai/library/demo:latest" -> "demo:latest";
    "registry.ollama.ai/org/demo" -> "org/demo:latest"). Names are compared by this key:
    config's duplicate check, API keys' ``models``, requests."""
    key = _full_name(name.strip()).lower()
    if key.startswith(_DEFAULT_HOST) and key.count("/") == 2:  # host/namespace/model
        key = key[len(_DEFAULT_HOST):]
    if key.startswith(_DEFAULT_NAMESPACE) and key.count("/") == 1:
        key = key[len(_DEFAULT_NAMESPACE):]
    return key


def _full_name(name: str) -> str:
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else f"{name}:latest"


def _v_name(v: object) -> str:
    if isinstance(v, str) and len(v) <= 256 and _NAME_RE.fullmatch(v):
        return v
    raise _Invalid(((), f"expected {_NAME_HINT}, got {_got(v)}"))


def _v_aliases(v: object) -> list[str]:
    if not isinstance(v, (list, tuple)):
        raise _Invalid(((), f"expected a list of model names, got {_got(v)}"))
    errs: list[tuple[Loc, str]] = []
    for i, item in enumerate(v):
        if not (isinstance(item, str) and _NAME_RE.fullmatch(item)):
            errs.append(((i,), f"expected {_NAME_HINT}, got {_got(item)}"))
    if errs:
        raise _Invalid(*errs)
    return list(v)


_GPUS_HINT = '"auto", a list of GPU indices like [0, 1] or a list of groups like [[0, 1], [2, 3]]'


def _v_gpus(v: object) -> Union[Literal["auto"], list[int], list[list[int]]]:
    """``"auto"`` | list of GPU indices | list of groups (lists) of GPU indices.

    A plain index and a group may be mixed (``[[0, 1], 2]``). Every GPU index may appear
    only once per model (a GPU cannot serve two workers of the same model).
    """
    if v == "auto" and isinstance(v, str):
        return "auto"
    if not isinstance(v, (list, tuple)):
        raise _Invalid(((), f"expected {_GPUS_HINT}, got {_got(v)}"))
    if not v:
        raise _Invalid(((), f"expected {_GPUS_HINT}, got []"))
    errs: list[tuple[Loc, str]] = []
    seen: dict[int, str] = {}
    out: list[Any] = []

    def index(g: object, loc: Loc) -> bool:
        if not (_is_int(g) and g >= 0):
            errs.append((loc, f"expected a GPU index (a non-negative integer), got {_got(g)}"))
            return False
        if g in seen:
            errs.append((loc, f"GPU {g} is already used by {seen[g]} (a GPU can serve only one worker per model)"))
            return False
        seen[g] = "gpus" + "".join(f"[{p}]" for p in loc)
        return True

    for i, item in enumerate(v):
        if isinstance(item, (list, tuple)):
            if not item:
                errs.append(((i,), "expected a non-empty group of GPU indices, got []"))
                continue
            for j, g in enumerate(item):
                index(g, (i, j))
            out.append(list(item))
        else:
            index(item, (i,))
            out.append(item)
    if errs:
        raise _Invalid(*errs)
    return out


def _v_slots_per_gpu(v: object) -> dict[int, int]:
    if not isinstance(v, dict):
        raise _Invalid(((), f"expected a mapping of GPU index to slot count like {{0: 8, 1: 4}}, got {_got(v)}"))
    out: dict[int, int] = {}
    errs: list[tuple[Loc, str]] = []
    for key, val in v.items():
        k = key
        if isinstance(k, str) and k.isdigit():  # JSON-style string keys
            k = int(k)
        if not (_is_int(k) and k >= 0):
            errs.append(((), f"expected GPU indices (non-negative integers) as keys, got {_got(key)}"))
            continue
        if not (_is_int(val) and val > 0):
            errs.append(((k,), f"expected a positive integer, got {_got(val)}"))
            continue
        out[k] = val
    if errs:
        raise _Invalid(*errs)
    return out


PositiveInt = Annotated[int, PlainValidator(_v_pos_int)]
OptPositiveInt = Annotated[Union[int, None], PlainValidator(_v_opt_pos_int)]
NonNegInt = Annotated[int, PlainValidator(_v_nonneg_int)]
StrictInt = Annotated[int, PlainValidator(_v_int)]
PositiveFloat = Annotated[float, PlainValidator(_v_pos_float)]
Interval = Annotated[float, PlainValidator(_v_interval)]
StrictBool = Annotated[bool, PlainValidator(_v_bool)]
StrList = Annotated[list[str], PlainValidator(_v_str_list)]

#: llama-server flags the gateway sets on every worker's command line and must own: how it
#: reaches the worker (``--host``, ``--port``, plain HTTP at the root path: ``--api-prefix``,
#: ``--ssl-*``; the per-start key in ``LLAMA_API_KEY``), which
#: model it loads and names (``-m``, ``--alias``, and the flags that fetch another model), and
#: the ``/slots`` endpoint it reads. llama-server takes the last of repeated flags, so one in
#: ``args`` won: with ``--port`` the gateway polled a port nobody listened on and a reload
#: waited ``startup_timeout_s`` for it (a fresh tester's find). ``-np`` and ``-c`` are the
#: operator's to override (the gateway reads the result back from ``/slots``).
GATEWAY_FLAGS = frozenset({
    "--host", "--port", "--api-key", "--api-key-file", "--api-prefix", "--ssl-key-file",
    "--ssl-cert-file", "-m", "--model", "-a", "--alias", "-mu", "--model-url", "-hf", "-hfr",
    "--hf-repo", "-hff", "--hf-file", "-dr", "--docker-repo", "--no-slots"})


def _v_worker_args(v: object) -> list[str]:
    """``args`` / ``extra_args``: a list of strings (see ``_v_str_list``) without any of
    :data:`GATEWAY_FLAGS` (also as ``--flag=value``), with whole numbers after ``-np`` / ``-c``,
    and without ``--flag=value`` items or a first item that is no flag, which llama-server
    refuses."""
    out = _v_str_list(v)
    errs = [((i,), f"{a.split('=', 1)[0]} is set by the gateway on every worker (it picks the "
                   f"host, port, API key, model and alias, and reads /slots over plain HTTP "
                   f"at the root path); remove it")
            for i, a in enumerate(out) if a.split("=", 1)[0] in GATEWAY_FLAGS]
    # llama-server's parser takes no --flag=value (common/arg.cpp looks the whole item up:
    # "invalid argument: --parallel=3", and the worker never started while check-config read
    # the 3; a fresh tester's find)
    joined = {i for i, a in enumerate(out) if _JOINED_FLAG.match(a)
              and a.split("=", 1)[0] not in GATEWAY_FLAGS}
    for i in sorted(joined):
        flag, _, value = out[i].partition("=")
        errs.append(((i,), f"llama-server takes a flag and its value as two items: "
                           f"{flag!r}, {value!r} (it refuses {out[i]!r} as an invalid argument)"))
    # -np / -c shape the worker plan (slots, context per slot): a value that is not a whole
    # number passed check-config and left the worker unable to start (a fresh tester's find)
    for i, v in flag_values(out, SLOT_FLAGS + CTX_FLAGS):
        if i not in joined and (v is None or not re.fullmatch(r"-?\d+", v)):
            errs.append(((i,), f"{out[i].partition('=')[0]} takes a whole number, got {_got(v)}"))
    # llama-server takes no positional argument: an item before any flag was its "invalid
    # argument: 5" at every start, after check-config passed it (a fresh tester's find)
    if out and not out[0].startswith("-"):
        errs.append(((0,), f"llama-server takes flags (and their values after them), got "
                           f"{out[0]!r} before any flag"))
    if errs:
        raise _Invalid(*errs)
    return out


#: A ``--flag=value`` (or ``-f=value``) item of ``args``, which llama-server refuses.
_JOINED_FLAG = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*=")

#: llama-server flags in ``args`` that change the worker plan (read back from ``/slots``):
#: its slots and its total context.
SLOT_FLAGS = ("-np", "--parallel")
CTX_FLAGS = ("-c", "--ctx-size")


def flag_values(args: list[str], names: tuple[str, ...]) -> list[tuple[int, str | None]]:
    """(index, value) of each flag of ``names`` in llama-server ``args``, given as
    ``--flag value`` or ``--flag=value``; the value is None when none follows."""
    out = []
    for i, a in enumerate(args):
        flag, eq, rest = a.partition("=")
        if flag in names:
            out.append((i, rest if eq else (args[i + 1] if i + 1 < len(args) else None)))
    return out


WorkerArgs = Annotated[list[str], PlainValidator(_v_worker_args)]


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


class _Section(BaseModel):
    """Base: frozen, unknown keys rejected, input must be a mapping with string keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _check_mapping(cls, data: Any) -> Any:
        if isinstance(data, BaseModel):
            return data
        if not isinstance(data, dict):
            raise _Invalid(((), f"expected a mapping, got {_got(data)}"))
        for key in data:
            if not isinstance(key, str):
                raise _Invalid(((), f"expected keys that are strings, got {_got(key)}"))
        return data


class LlamaServerConfig(_Section):
    """How llama-server processes are found and launched (``llama_server:``)."""

    binary: Annotated[Union[str, None], PlainValidator(_v_opt_str)] = None
    """Path to llama-server (``~`` expanded); None: ``$LLAMA_SERVER``, then PATH, then the cached build."""
    backend: Annotated[Literal["auto", "cpu", "cuda"], PlainValidator(_choice("auto", "cpu", "cuda"))] = "auto"
    """Which llama-server build to use: "auto" (CUDA when a GPU is found), "cpu" or "cuda"."""
    threads: OptPositiveInt = None
    """``-t`` per CPU worker; None: the machine's cores split evenly among CPU workers."""
    extra_args: WorkerArgs = Field(default_factory=list)
    """Arguments appended to every worker's command line."""
    startup_timeout_s: PositiveFloat = 180.0
    """Seconds a worker may take from spawn to a healthy ``/health`` (model load)."""
    health_interval_s: Interval = 0.25
    """Seconds between health polls."""
    restart_backoff_initial_s: PositiveFloat = 0.5
    """First delay (s) before restarting a crashed worker; doubles per consecutive crash."""
    restart_backoff_max_s: PositiveFloat = 30.0
    """Upper bound (s) of the restart delay."""
    stop_grace_s: PositiveFloat = 10.0
    """Seconds between SIGTERM and SIGKILL when stopping a worker."""
    liveness_interval_s: Interval = 2.0
    """Seconds between liveness probes of a ready worker (``GET /slots`` with a timeout)."""
    liveness_timeout_s: PositiveFloat = 5.0
    """Seconds a liveness probe may take; 2 failures in a row mark the worker wedged."""
    wedge_after_stalls: PositiveInt = 2
    """Stalled requests (watchdog timeouts) in a row, with no token in between, after which a
    worker is checked (``workers.stall_check``: main loop answers, a slot free or moving, within
    ``liveness_timeout_s``) and, if it fails, treated as wedged and restarted even though it
    still answers the ``/slots`` probes."""
    leaked_slot_s: Annotated[float, PlainValidator(_v_nonneg_float)] = 60.0
    """Seconds a worker slot may stay busy with one task while no live request of the gateway
    on that worker is older than the task (``gateway.scheduling.slot_leaks``); then the slot
    is taken as leaked and the worker restarted as an admin restart does it (drain up to
    ``shutdown.drain_s``, stop, start). 0 turns it off. It must outlast llama-server's lag in
    freeing a cancelled request's slot (about 0.5–2 s here, up to one prompt batch on a slow
    CPU): a shorter one restarts workers that are merely slow to free a slot."""
    crash_loop_restarts: PositiveInt = 5
    """Crashes (runs that ended: exits, wedges, failed starts) within ``crash_loop_window_s``
    that mark a worker ``failed`` (crash loop), or as many starts in a row that did not get
    ready. (The name predates the count: each crash but the last is followed by a restart.)"""
    crash_loop_window_s: PositiveFloat = 120.0
    """Window (s) in which ``crash_loop_restarts`` crashes count as a crash loop."""
    failed_retry_s: PositiveFloat = 300.0
    """Seconds a ``failed`` worker waits before it is tried again."""
    spare_connections: StrictBool = True
    """Open the connection for a worker's next request right after a request was sent to it
    (used once, never reused; ``gateway.worker_http.SpareConnections``): saves the connect,
    about 0.2 ms of TTFT. False: connect when the request is sent. Read at start."""

    @model_validator(mode="after")
    def _c_backoff(self) -> "LlamaServerConfig":
        if self.restart_backoff_initial_s > self.restart_backoff_max_s:  # passed without a word
            _fail(f"{self.restart_backoff_initial_s:g} s is more than restart_backoff_max_s "
                  f"({self.restart_backoff_max_s:g} s), the most a restart delay grows to",
                  "restart_backoff_initial_s")
        return self


class QueueConfig(_Section):
    """The gateway's wait queue in front of busy workers (``queue:``)."""

    max_pending: NonNegInt = 512
    """Requests allowed to wait for a free slot (Ollama's OLLAMA_MAX_QUEUE default); more get 503."""
    timeout_s: PositiveFloat = 600.0
    """Longest wait (s) in the gateway queue before answering 503."""
    retry_after_s: PositiveInt = 2
    """Seconds sent in the Retry-After header of 503 answers (the refusal for crash-loop
    ``failed`` workers sends the seconds to their next start instead)."""
    header_priority: StrictBool = True
    """Take a request's priority class from its ``X-Priority`` header (when its API key sets
    none); false: only API keys and models set priorities, so a client cannot move itself
    ahead of others."""


class SchedulerConfig(_Section):
    """How requests are spread over workers (``scheduler:``); see gateway/scheduling/scorer.py."""

    policy: Annotated[
        Literal["least_loaded", "least_connections", "round_robin", "random", "pack"],
        PlainValidator(_choice("least_loaded", "least_connections", "round_robin", "random", "pack")),
    ] = "least_loaded"
    """Worker choice: "least_loaded" (slots, KV headroom, worker queue, speed, prefix affinity);
    baselines "least_connections", "round_robin", "random", "pack" (fill worker 0 first)."""
    prefix_affinity: StrictBool = True
    """least_loaded only: send requests sharing a prompt prefix to the same worker (bounded load)."""
    affinity_bound: Annotated[float, PlainValidator(_v_at_least_one)] = 2.0
    """A worker keeps prefix affinity while its occupancy stays within this factor of the
    fleet average (consistent hashing with bounded loads); >= 1."""
    affinity_wait_ms_per_1k_tokens: Annotated[float, PlainValidator(_v_nonneg_float)] = 0.0
    """Delay scheduling for prefix affinity (Zaharia et al., EuroSys 2010): a queued request
    whose prefix is held by a worker with no free slot (or over its load bound) may wait for
    that worker while others take the free slot, for the held tokens (beyond what a free worker
    holds) × this estimate of prefill milliseconds per 1,000 prompt tokens; 0 turns it off."""
    affinity_wait_max_s: Annotated[float, PlainValidator(_v_nonneg_float)] = 1.0
    """Longest such wait (s), counted from the request's admission; then any worker takes it."""
    prefix_bytes: PositiveInt = 512
    """Bytes of the prompt's head (system prompt / first messages) hashed into the prefix key."""
    kv_weight: Annotated[float, PlainValidator(_v_nonneg_float)] = 0.5
    """Weight of KV-cache fill against slot occupancy in least_loaded's cost."""
    prefill_weight: Annotated[float, PlainValidator(_v_nonneg_float)] = 0.5
    """Weight of a worker's prefill backlog (prompt tokens of its requests that have no first
    token yet, per slot context) in least_loaded's cost; 0 turns it off."""
    measured_speed: StrictBool = True
    """least_loaded only: weigh each worker by its measured decode speed relative to the
    model's other workers (gateway/speed.py; mixed GPU models). False: every worker counts as
    equally fast (``speed`` 1.0 in ``/gateway/api/workers``); its per-sequence decode rate is
    still measured and shown (``sequence_tokens_per_s``)."""
    poll_interval_s: Interval = 0.25
    """Seconds between polls of each worker's /slots and /metrics."""
    poll_timeout_s: PositiveFloat = 1.0
    """Timeout (s) of one /slots or /metrics poll."""
    aging_s: PositiveFloat = 10.0
    """Seconds of waiting that raise a queued request's priority by one class."""
    bytes_per_token: PositiveFloat = 4.0
    """Prompt bytes per token used for size estimates until a worker's tokenizer was measured."""
    unknown_num_predict_tokens: PositiveInt = 512
    """Tokens assumed for KV planning when a request sets no num_predict limit."""


class TimeoutsConfig(_Section):
    """Upstream time limits (``timeouts:``)."""

    first_byte_s: PositiveFloat = 300.0
    """Seconds allowed until a worker sends the first byte of its answer."""
    request_s: PositiveFloat = 3600.0
    """Deadline (s) of one whole request, queueing included."""
    inter_token_s: PositiveFloat = 60.0
    """Longest silence (s) of a worker between two pieces of a streamed answer."""
    header_read_s: PositiveFloat = 30.0
    """Seconds a client may take to send its request line and headers (also the idle
    keep-alive timeout of client connections)."""
    body_read_s: PositiveFloat = 60.0
    """Seconds a client may take to send its request body (then 408)."""
    client_write_s: PositiveFloat = 30.0
    """Seconds a client may leave a full write buffer unread before it is dropped and its
    slot freed."""


def _v_sha256(v: object) -> str:
    if isinstance(v, str) and re.fullmatch(r"[0-9a-fA-F]{64}", v):
        return v.lower()
    raise _Invalid(((), f"expected a SHA-256 hex digest (64 hex digits, from `llama-gateway hash-key`), got {_got(v)}"))


def _v_origins(v: object) -> list[str]:
    if not isinstance(v, (list, tuple)):
        raise _Invalid(((), f'expected a list of origins like ["http://localhost:3000"], got {_got(v)}'))
    errs: list[tuple[Loc, str]] = []
    for i, item in enumerate(v):
        if not (isinstance(item, str) and (item == "*" or re.fullmatch(
                r"[A-Za-z][A-Za-z0-9+.\-]*://[^/\s]+", item))):
            errs.append(((i,), 'expected "*" or an origin like "http://host:port" or '
                               f'"chrome-extension://*" (no path), got {_got(item)}'))
    if errs:
        raise _Invalid(*errs)
    return [o.lower() for o in v]


class LimitsConfig(_Section):
    """Bounds on what one request may ask (``limits:``)."""

    max_body_bytes: PositiveInt = 64 * 1024 * 1024
    """Largest request body in bytes; larger bodies get 413."""
    max_messages: PositiveInt = 4096
    """Most entries in a request's ``messages`` list; more get 400."""
    check_prompt_length: StrictBool = True
    """Reject (400) a prompt that cannot fit one slot's context, before it reaches a worker."""
    write_buffer_bytes: PositiveInt = 262144
    """Bytes of a streamed answer buffered for a client that does not read; beyond that the
    stream waits, and after ``timeouts.client_write_s`` the client is dropped."""


class ApiKeyConfig(_Section):
    """One client API key (an entry of ``auth.keys``), stored as a hash only."""

    name: Annotated[str, PlainValidator(_v_name_label)]
    """Label for logs and errors (never the key)."""
    sha256: Annotated[str, PlainValidator(_v_sha256)]
    """SHA-256 hex digest of the key (``llama-gateway hash-key``)."""
    models: Annotated[list[str], PlainValidator(_v_model_patterns)] = Field(default_factory=lambda: ["*"])
    """Models (names or aliases) this key may use; ["*"] = all."""
    priority: Annotated[Union[int, None], PlainValidator(_v_opt_priority)] = None
    """Priority class of this key's requests (overrides the model's); null = the model's."""
    max_concurrent: OptPositiveInt = None
    """Requests of this key in flight at once; more get 429. null = no cap."""
    rate_per_minute: OptPositiveInt = None
    """Requests per minute (token bucket, burst of the same size); more get 429. null = no limit."""
    admin: StrictBool = False
    """May use the gateway's own ``/gateway/`` endpoints and ``/metrics``."""


class AuthConfig(_Section):
    """Client authentication (``auth:``). With no keys, the gateway is open (as Ollama)."""

    keys: list[ApiKeyConfig] = Field(default_factory=list)
    """Accepted keys; a request must send one as ``Authorization: Bearer <key>``."""
    metrics_public: StrictBool = False
    """With keys: false (default) = ``/metrics`` (which names every model and worker) needs the
    admin token or an ``admin: true`` key, as ``/gateway/api/workers`` does; true = open to
    anyone who can reach the port (a scraper on a trusted network). Without keys it is open."""

    @model_validator(mode="after")
    def _unique(self) -> "AuthConfig":
        seen: dict[str, int] = {}
        errs: list[tuple[Loc, str]] = []
        for i, k in enumerate(self.keys):
            if k.sha256 in seen:
                errs.append((("keys", i, "sha256"), f"same key as keys[{seen[k.sha256]}]"))
            seen.setdefault(k.sha256, i)
        if errs:
            raise _Invalid(*errs)
        return self


class HttpConfig(_Section):
    """Browser-facing HTTP rules (``http:``)."""

    cors_origins: Annotated[list[str], PlainValidator(_v_origins)] = Field(default_factory=list)
    """Origins allowed besides Ollama's defaults (``gateway.auth.DEFAULT_ORIGINS``: local pages,
    apps, editors' webviews, browser extensions), e.g. "https://chat.example.com",
    "http://192.168.1.20:*"; ``*`` matches any text, dots included, "*" alone every origin. A request from any
    other origin (``Origin`` header, not the gateway's own) gets 403, as with Ollama."""
    check_host: StrictBool = True
    """When listening on a loopback address, answer 403 to a Host header that is not local
    (DNS-rebinding defence, as Ollama's allowedHostsMiddleware)."""


class GenerationConfig(_Section):
    """Generation defaults and limits (``generation:``)."""

    num_predict_default: Annotated[int, PlainValidator(_v_num_predict)] = -1
    """Tokens to generate when a request sets no num_predict; -1 = until end of text/context (as Ollama)."""
    num_predict_max: OptPositiveInt = None
    """Upper bound (tokens) for any request's num_predict; None = no bound."""
    template_shapes: StrictBool = True
    """Fill chat templates in from renders learned by the chat's shape
    (``gateway.template_shapes``) instead of a worker's ``/apply-template`` per request;
    false: the worker renders every chat (for a template that rewrites or tests the text of
    messages, which the learned shapes cannot see)."""

    @model_validator(mode="after")
    def _default_within_max(self) -> "GenerationConfig":
        if self.num_predict_max is not None and self.num_predict_default > self.num_predict_max:
            _fail(
                f"must not exceed num_predict_max ({self.num_predict_max}), got {self.num_predict_default}",
                "num_predict_default",
            )
        return self


class LogConfig(_Section):
    """Logging (``log:``)."""

    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        PlainValidator(_choice("debug", "info", "warning", "error")),
    ] = "info"
    format: Annotated[
        Literal["auto", "json", "console"], PlainValidator(_choice("auto", "json", "console"))
    ] = "auto"
    """"auto": JSON lines unless stderr is a TTY."""


class ShutdownConfig(_Section):
    """Graceful stop on SIGTERM (``shutdown:``)."""

    drain_s: PositiveFloat = 30.0
    """Seconds in-flight requests may run on after SIGTERM (and while a worker drains for a
    reload or an admin restart) before they are ended with an error line. Keep systemd's
    TimeoutStopSec above drain_s + llama_server.stop_grace_s."""


class AdminConfig(_Section):
    """The admin API (``admin:``): worker drain/undrain/restart and config reload."""

    token: Annotated[Union[str, None], PlainValidator(_v_opt_secret)] = None
    """Bearer token for ``/gateway/api/admin/*``; None: ``$LLAMA_GATEWAY_ADMIN_TOKEN``, and
    without either the admin API answers 403."""


class ModelConfig(_Section):
    """One served model (an entry of ``models:``).

    Raises (via :func:`parse_config`): bad names, a missing .gguf file, an unknown builtin,
    bad GPU lists (a GPU in two groups), ``cpu`` given together with ``gpus``.
    """

    name: Annotated[str, PlainValidator(_v_name)]
    """Ollama-style name: "demo", "demo:latest", "ns/demo:7b"."""
    path: str
    """"builtin:demo" or an absolute path to a .gguf (``~`` expanded, relative paths resolved
    against the config file's directory); the file must exist."""
    aliases: Annotated[list[str], PlainValidator(_v_aliases)] = Field(default_factory=list)
    """Other names the model answers to."""
    slots: PositiveInt = 4
    """Parallel sequences per worker (llama-server ``-np``)."""
    context: PositiveInt = 4096
    """Context tokens per slot; the worker gets ``-c slots*context``."""
    args: WorkerArgs = Field(default_factory=list)
    """Extra llama-server arguments for this model's workers."""
    embeddings: StrictBool = False
    """Start the workers with ``--embeddings``."""
    gpus: Annotated[
        Union[Literal["auto"], list[int], list[list[int]]], PlainValidator(_v_gpus)
    ] = "auto"
    """"auto" (one worker per detected GPU), a list of GPU indices (one worker each) or a
    list of groups (one worker per group, split across the group's GPUs)."""
    cpu: OptPositiveInt = None
    """Run N CPU-only workers instead (``CUDA_VISIBLE_DEVICES=""``); excludes ``gpus``."""
    cpu_fallback: NonNegInt = 1
    """CPU workers to start when ``gpus: auto`` finds no GPU (0: none)."""
    slots_per_gpu: Annotated[dict[int, int], PlainValidator(_v_slots_per_gpu)] = Field(default_factory=dict)
    """Per-GPU override of ``slots``; a group worker uses the entry of its first GPU."""
    priority: Annotated[int, PlainValidator(_v_priority)] = 0
    """Default priority class of this model's requests (higher is served first), within
    ±:data:`PRIORITY_LIMIT`."""

    @field_validator("path", mode="plain")
    @classmethod
    def _check_path(cls, v: object, info: ValidationInfo) -> str:
        if not (isinstance(v, str) and v.strip()):
            raise _Invalid(((), f'expected a path to a .gguf file or "builtin:demo", got {_got(v)}'))
        if v.startswith("builtin:"):
            name = v[len("builtin:"):]
            if name not in BUILTIN_MODELS:
                avail = ", ".join(f'"builtin:{b}"' for b in BUILTIN_MODELS)
                raise _Invalid(((), f"unknown builtin model {_got(name)} (available: {avail})"))
            return v
        p = os.path.expanduser(v)
        base = (info.context or {}).get("base_dir") if info is not None else None
        if not os.path.isabs(p):
            p = os.path.join(base or os.getcwd(), p)
        p = os.path.normpath(p)
        if not os.path.exists(p):
            raise _Invalid(((), f"file not found: {p}"))
        if not os.path.isfile(p):
            raise _Invalid(((), f"not a regular file: {p}"))
        return p

    @model_validator(mode="after")
    def _cpu_xor_gpus(self) -> "ModelConfig":
        if self.cpu is not None and "gpus" in self.model_fields_set:
            _fail(
                f"cannot be combined with gpus (set one or the other), got cpu: {self.cpu} "
                f"and gpus: {_got(self.gpus)}",
                "cpu",
            )
        if self.cpu is not None and self.slots_per_gpu:  # was ignored without a word
            _fail(f"applies to GPU workers, but this model runs {self.cpu} CPU worker(s) "
                  f"(cpu: {self.cpu}); set their slots with slots", "slots_per_gpu")
        return self

    @model_validator(mode="after")
    def _c_fits_llama_server(self) -> "ModelConfig":
        """llama-server reads ``-c`` (slots × context) with ``std::stoi``: past a 32-bit int
        its workers exit at start (``error while handling argument "-c": stoi``), as they do
        with more than :data:`MAX_SLOTS` slots."""
        slots = max([self.slots, *self.slots_per_gpu.values()])
        if slots > MAX_SLOTS:
            _fail(f"{slots} slots per worker is more than llama.cpp's {MAX_SLOTS} sequences "
                  f"per context (LLAMA_MAX_SEQ; its workers exit at start: n_seq_max must be "
                  f"<= {MAX_SLOTS})", "slots_per_gpu" if slots > self.slots else "slots")
        np_args = [int(v) for _, v in flag_values(self.args, SLOT_FLAGS) if v and v.isdigit()]
        if np_args and max(np_args) > MAX_SLOTS:
            _fail(f"-np {max(np_args)} is more than llama.cpp's {MAX_SLOTS} sequences per "
                  f"context (LLAMA_MAX_SEQ; its workers exit at start)", "args")
        if slots * self.context > INT32_MAX:
            _fail(f"slots × context is {slots} × {self.context} = {slots * self.context} "
                  f"tokens, more than llama-server's -c takes ({INT32_MAX})", "context")
        return self

    @property
    def full_name(self) -> str:
        """The name with ":latest" appended when it has no tag ("demo" -> "demo:latest")."""
        return _full_name(self.name)

    @property
    def names(self) -> tuple[str, ...]:
        """Full names (``:latest`` appended when untagged) of the name and every alias."""
        return (self.full_name, *(_full_name(a) for a in self.aliases))

    @property
    def is_builtin(self) -> bool:
        """True for ``path: "builtin:..."`` (a model the gateway writes itself)."""
        return self.path.startswith("builtin:")

    @property
    def builtin_name(self) -> str | None:
        """"demo" for ``builtin:demo``; None for a file path."""
        return self.path[len("builtin:"):] if self.is_builtin else None

    @property
    def gpu_groups(self) -> tuple[tuple[int, ...], ...] | None:
        """Explicit GPUs as one tuple per worker (``[0, 1]`` -> ((0,), (1,))); None for "auto"."""
        if self.gpus == "auto":
            return None
        return tuple(tuple(g) if isinstance(g, list) else (g,) for g in self.gpus)  # type: ignore[union-attr]

    @property
    def worker_base(self) -> str:
        """Prefix of this model's worker ids: name without ":latest", other ':' -> '-', '/' -> '_'."""
        full = self.full_name
        if full.endswith(":latest"):
            full = full[: -len(":latest")]
        return full.replace(":", "-").replace("/", "_")


_SECTIONS = ("llama_server", "queue", "scheduler", "timeouts", "generation", "log", "shutdown",
             "admin", "limits", "auth", "http")


class GatewayConfig(_Section):
    """The whole gateway configuration (the YAML file's top level)."""

    listen: Annotated[str, PlainValidator(_v_listen)] = "127.0.0.1:11434"
    """Address of the Ollama API, "host:port"; IPv6 as "[::1]:11434"; port 0 = any free port."""
    llama_server: LlamaServerConfig = Field(default_factory=LlamaServerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    models: list[ModelConfig]

    _source: str = PrivateAttr(default="<config>")

    @field_validator(*_SECTIONS, mode="before")
    @classmethod
    def _empty_section(cls, v: Any) -> Any:
        # "queue:" with every child commented out parses as null: use the defaults.
        return {} if v is None else v

    @field_validator("models", mode="before")
    @classmethod
    def _models_list(cls, v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            raise _Invalid(((), f"expected a list of models, got {_got(v)}"))
        if not v:
            raise _Invalid(((), "expected at least one model, got []"))
        return v

    @model_validator(mode="after")
    def _unique_names(self) -> "GatewayConfig":
        errs: list[tuple[Loc, str]] = []
        seen: dict[str, str] = {}
        bases: dict[str, int] = {}
        for i, m in enumerate(self.models):
            entries: list[tuple[Loc, str]] = [(("models", i, "name"), m.name)]
            entries += [(("models", i, "aliases", j), a) for j, a in enumerate(m.aliases)]
            name_dup = False
            for loc, name in entries:
                key = normalize_model_name(name)
                if key in seen:
                    errs.append((loc, f"duplicate model name {_got(_full_name(name))} (already used by {seen[key]})"))
                    name_dup = name_dup or loc[-1] == "name"
                else:
                    seen[key] = _path(loc)
            base = m.worker_base.lower()
            if name_dup:
                pass
            elif base in bases:
                errs.append(
                    (
                        ("models", i, "name"),
                        f"worker ids {_got(m.worker_base)} would clash with those of "
                        f"models[{bases[base]}] ({_got(self.models[bases[base]].name)}); rename one",
                    )
                )
            else:
                bases[base] = i
        if errs:
            raise _Invalid(*errs)
        return self

    @model_validator(mode="after")
    def _key_models_exist(self) -> "GatewayConfig":
        """An API key's ``models`` name configured models (or aliases): a typo gave a key that
        could use nothing, without a word (a fresh tester's find)."""
        errs = [(("auth", "keys", i, "models", j),
                 f"no model or alias named {_got(pattern)} in models")
                for i, k in enumerate(self.auth.keys) for j, pattern in enumerate(k.models)
                if pattern != "*" and self.find_model(pattern) is None]
        if errs:
            raise _Invalid(*errs)
        return self

    @property
    def host(self) -> str:
        """Host part of ``listen`` (IPv6 without brackets: "::1")."""
        return _split_listen(self.listen)[0]  # type: ignore[index]

    @property
    def port(self) -> int:
        """Port part of ``listen``."""
        return _split_listen(self.listen)[1]  # type: ignore[index]

    @property
    def source(self) -> str:
        """File name the config was loaded from ("<config>" when parsed from data)."""
        return self._source

    def find_model(self, name: str) -> ModelConfig | None:
        """The model whose name or alias matches ``name`` (case-insensitive, ":latest" implied)."""
        key = normalize_model_name(name)
        for m in self.models:
            if any(n.lower() == key for n in m.names):
                return m
        return None


# --------------------------------------------------------------------------------------
# ValidationError -> our messages
# --------------------------------------------------------------------------------------

_MISSING_HINT = {
    "models": "a list of models",
    "name": _NAME_HINT,
    "path": 'a path to a .gguf file or "builtin:demo"',
}


def _fields_at(loc: Loc) -> list[str]:
    """Valid keys of the mapping at ``loc`` (for unknown-key suggestions)."""
    cls: type[BaseModel] | None
    if not loc:
        cls = GatewayConfig
    elif loc[0] == "models" and len(loc) == 2:
        cls = ModelConfig
    elif loc[:2] == ("auth", "keys") and len(loc) == 3:
        cls = ApiKeyConfig
    elif len(loc) == 1 and loc[0] in _SECTIONS:
        cls = GatewayConfig.model_fields[loc[0]].annotation  # type: ignore[assignment]
    else:
        cls = None
    return list(cls.model_fields) if cls is not None else []


def _translate(exc: ValidationError) -> list[str]:
    out: list[str] = []
    for err in exc.errors(include_url=False):
        loc: Loc = tuple(err["loc"])
        typ = err["type"]
        ctx = err.get("ctx") or {}
        inv = ctx.get("error")
        if isinstance(inv, _Invalid):
            out.extend(_line(loc + sub, msg) for sub, msg in inv.items)
        elif typ == "extra_forbidden":
            valid = _fields_at(loc[:-1])
            match = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
            if match:
                out.append(_line(loc, f'unknown key (did you mean "{match[0]}"?)'))
            elif valid:
                out.append(_line(loc, f"unknown key (expected one of: {', '.join(valid)})"))
            else:
                out.append(_line(loc, "unknown key"))
        elif typ == "missing":
            hint = _MISSING_HINT.get(str(loc[-1])) if loc else None
            if loc[:1] == ("auth",) and loc[-1] == "name":  # an API key's name is a label
                hint = "a label for logs, like \"webui\""
            elif loc[:1] == ("auth",) and loc[-1] == "sha256":
                hint = "the key's SHA-256 hex digest (llama-gateway hash-key)"
            out.append(_line(loc, f"required key is missing (expected {hint})" if hint else "required key is missing"))
        elif typ in ("model_type", "model_attributes_type", "dict_type"):
            out.append(_line(loc, f"expected a mapping, got {_got(err.get('input'))}"))
        else:  # not expected with our validators; keep pydantic's wording
            msg = str(err.get("msg", "invalid value"))
            out.append(_line(loc, f"{msg[0].lower()}{msg[1:]}, got {_got(err.get('input'))}"))
    return out


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def parse_config(data: object, source: str = "<config>", *, base_dir: str | os.PathLike | None = None) -> GatewayConfig:
    """Validate already-parsed config data (e.g. from YAML) into a frozen :class:`GatewayConfig`.

    Args:
        data: the top-level mapping.
        source: file name used to prefix error lines.
        base_dir: directory relative model paths are resolved against (default: the CWD).

    Raises:
        ConfigError: with every problem found, one ``"<key path>: <message>"`` per entry.
    """
    ctx = {"base_dir": os.fspath(base_dir) if base_dir is not None else None}
    try:
        cfg = GatewayConfig.model_validate(data, context=ctx)
    except ValidationError as exc:
        raise ConfigError(_translate(exc), source) from None
    cfg._source = str(source)
    return cfg


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys in a mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        if isinstance(node, yaml.MappingNode):
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    dup = key in seen
                except TypeError:  # unhashable key; SafeLoader reports it itself
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {_got(key)}", key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike) -> GatewayConfig:
    """Read and validate a YAML config file.

    Relative model paths are resolved against the file's directory.

    Raises:
        ConfigError: file missing/unreadable (``"file not found"``), YAML syntax errors
            (``"line L, column C: invalid YAML: ..."``, duplicate keys included) and every
            validation problem (see :func:`parse_config`); ``str(e)`` prefixes each with the
            file name.
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError("file not found", source) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, expected a YAML file", source) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", source) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "syntax error"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{where}invalid YAML: {problem}", source) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", source) from None
    if data is None:
        raise ConfigError("the file is empty, expected a mapping of settings with at least \"models\"", source)
    return parse_config(data, source, base_dir=os.path.dirname(os.path.abspath(source)))


# --------------------------------------------------------------------------------------
# Worker planning
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerPlan:
    """One llama-server process to run.

    Attributes:
        id: stable worker id, e.g. "demo-gpu0", "demo-gpu0+1", "demo-cpu1".
        model: the model's full name ("demo:latest").
        gpus: GPU indices the worker uses; empty for a CPU worker.
        slots: parallel sequences (``-np``).
        context: context tokens per slot.
    """

    id: str
    model: str
    gpus: tuple[int, ...]
    slots: int
    context: int

    @property
    def total_context(self) -> int:
        """Tokens of the worker's whole context (``-c``): slots * context."""
        return self.slots * self.context

    @property
    def is_cpu(self) -> bool:
        """True for a CPU-only worker (no GPU)."""
        return not self.gpus


def models_without_workers(config: GatewayConfig, plans: list[WorkerPlan]) -> list[str]:
    """Full names of the configured models that ``plans`` give no worker (``gpus: auto`` found
    no GPU and ``cpu_fallback`` is 0), in config order."""
    planned = {p.model for p in plans}
    return [m.full_name for m in config.models if m.full_name not in planned]


def plan_workers(config: GatewayConfig, detected_gpus: list[int]) -> list[WorkerPlan]:
    """Workers for every model, in config order.

    * ``cpu: N`` -> N CPU workers ``<base>-cpu<i>``;
    * ``gpus: auto`` -> one worker ``<base>-gpu<g>`` per detected GPU, or ``cpu_fallback``
      CPU workers when ``detected_gpus`` is empty;
    * explicit GPUs -> one worker per index / group (``<base>-gpu0+1`` for a group).

    Slots come from ``slots_per_gpu[first GPU]`` when present, else ``slots``.

    Raises:
        ConfigError: explicit GPU indices that are not in ``detected_gpus``
            (``models[0].gpus: GPU 3 not found (found: 0, 1)``), or explicit GPUs while no
            GPU was detected.
    """
    detected = list(dict.fromkeys(detected_gpus))
    found = set(detected)
    plans: list[WorkerPlan] = []
    errors: list[str] = []
    for i, m in enumerate(config.models):
        base = m.worker_base

        def cpu_workers(n: int) -> list[WorkerPlan]:
            return [WorkerPlan(f"{base}-cpu{k}", m.full_name, (), m.slots, m.context) for k in range(n)]

        def gpu_worker(group: tuple[int, ...]) -> WorkerPlan:
            wid = f"{base}-gpu" + "+".join(str(g) for g in group)
            return WorkerPlan(wid, m.full_name, group, m.slots_per_gpu.get(group[0], m.slots), m.context)

        groups = m.gpu_groups
        if m.cpu is not None:
            plans.extend(cpu_workers(m.cpu))
        elif groups is None:
            if detected:
                plans.extend(gpu_worker((g,)) for g in detected)
            else:
                plans.extend(cpu_workers(m.cpu_fallback))
        elif not detected:
            errors.append(
                f"models[{i}].gpus: no NVIDIA GPU detected, got gpus: {_got(m.gpus)} "
                f"(use gpus: auto with cpu_fallback, or cpu: N, to run on CPU)"
            )
        else:
            missing = sorted({g for grp in groups for g in grp} - found)
            if missing:
                what = f"GPU {missing[0]}" if len(missing) == 1 else "GPUs " + ", ".join(map(str, missing))
                errors.append(f"models[{i}].gpus: {what} not found (found: {', '.join(map(str, detected))})")
            else:
                plans.extend(gpu_worker(grp) for grp in groups)
    if errors:
        raise ConfigError(errors, config.source)
    return plans


@dataclass(frozen=True)
class PlanDiff:
    """Result of :func:`diff_plans`; lists hold plans from ``new`` except ``removed`` (from ``old``)."""

    added: list[WorkerPlan] = field(default_factory=list)
    removed: list[WorkerPlan] = field(default_factory=list)
    changed: list[WorkerPlan] = field(default_factory=list)
    unchanged: list[WorkerPlan] = field(default_factory=list)

    @property
    def has_changes(self) -> bool:
        """True when any worker must be started, stopped or restarted."""
        return bool(self.added or self.removed or self.changed)


def fingerprint(plan: WorkerPlan, cfg: GatewayConfig | None, trained: int = 0) -> tuple:
    """What a worker of ``plan`` runs under ``cfg``, compared by :func:`diff_plans`: the plan
    (model, GPUs, and the ``-np`` and per-slot context it is started with: the plan's slots and
    context after the model's args and the cap at its training context ``trained``, tokens, 0
    unknown; ``gateway.slot_plan.launch_slots``), the model's path/args/embeddings and
    ``llama_server.binary/backend/extra_args`` (``threads`` for CPU workers). Two contexts
    above the training context are the same command line: a reload between them restarts
    nothing (it restarted the workers; a tester's find)."""
    from gateway.slot_plan import launch_slots  # slot_plan imports this module

    m = cfg.find_model(plan.model) if cfg is not None else None
    ls = cfg.llama_server if cfg is not None else None
    model_part = (m.path, tuple(m.args), m.embeddings) if m is not None else None
    server_part = (
        (ls.binary, ls.backend, tuple(ls.extra_args), ls.threads if plan.is_cpu else None)
        if ls is not None
        else None
    )
    slots, context = plan.slots, plan.context
    if m is not None and ls is not None:
        slots, context, _ = launch_slots(list(ls.extra_args) + list(m.args), slots, context,
                                         trained)
    return (plan.model, plan.gpus, slots, context, model_part, server_part)


def diff_plans(
    old: list[WorkerPlan],
    new: list[WorkerPlan],
    old_cfg: GatewayConfig | None,
    new_cfg: GatewayConfig | None,
    running: dict[str, tuple] | None = None,
    trained: dict[str, int] | None = None,
) -> PlanDiff:
    """Compare worker plans by id (for hot reload).

    A worker present in both is ``changed`` when its settings :func:`fingerprint` differs;
    ``running`` (worker id → fingerprint) gives what a worker's process really runs where it
    differs from ``old`` under ``old_cfg`` (a reload that put a worker back on its previous
    settings, gateway/reload.py). ``trained``: model full name → training context (tokens;
    missing or 0: unknown), for the fingerprints' context cap. ``changed``/``unchanged``/
    ``added`` hold the new plans in ``new`` order; ``removed`` holds old plans in ``old`` order.
    """
    running = running or {}
    trained = trained or {}
    old_by_id = {p.id: p for p in old}
    new_ids = {p.id for p in new}
    diff = PlanDiff()
    for p in new:
        prev = old_by_id.get(p.id)
        if prev is None:
            diff.added.append(p)
        elif (running.get(p.id, fingerprint(prev, old_cfg, trained.get(prev.model, 0)))
              != fingerprint(p, new_cfg, trained.get(p.model, 0))):
            diff.changed.append(p)
        else:
            diff.unchanged.append(p)
    diff.removed.extend(p for p in old if p.id not in new_ids)
    return diff
