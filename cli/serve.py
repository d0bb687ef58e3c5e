"""`localserve serve [NAME]`: the OpenAI-compatible daemon (Starlette on uvicorn).

With no NAME it serves smollm2-135m, pulling it at 4 bits first if the store has none.
SIGTERM drains: new requests get 503, in-flight ones finish (up to --drain-timeout), then the
process exits 0. A second SIGTERM or Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace

import uvicorn

from server.api.generation.tool_formats import CHOICES as TOOL_FORMATS
from server.api.held import Route, check_routes, default_memory_limit
from server.models.tokenizer import REASONING_CHOICES

DEFAULT_MODEL = "smollm2-135m"
log = logging.getLogger("localserve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    p.add_argument("name", nargs="*", help=f"stored models to load at start and keep, the "
                   f"first the default (default: {DEFAULT_MODEL}, pulled at 4 bits if missing); "
                   "requests may name any other stored model too")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics (repeatable; "
                   "or LOCALSERVE_API_KEY, comma-separated)")
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from ORIGIN (e.g. https://app.example.com; * for any) call "
                   "the API from a browser; pages on localhost/127.0.0.1 always can (repeatable)")
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="KV cache pool (default: a fifth of available memory)")
    p.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="prefix-cache memory kept beyond running requests before fresh memory "
                   "is preferred to it (default 256)")
    p.add_argument("--idle-release-seconds", type=float, default=300.0,
                   help="after this long idle, hand KV memory back to the OS but "
                   "--idle-cache-mb of cache (default 300; 0: never)")
    p.add_argument("--idle-cache-mb", type=int, default=0,
                   help="prefix cache an idle server keeps (default 0)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default=None, choices=("bf16", "fp32"),
                   help="storage of the KV pool (default: bf16 where the CPU has no native "
                        "bf16, else the compute dtype); fp32 under fp32 compute holds half the "
                        "tokens per MB, for decimals beyond bf16's (the greedy answers measured "
                        "were the same)")
    p.add_argument("--max-itl-stretch", type=float, default=1.5,
                   help="a step that decodes may take at most this multiple of a decode-only "
                        "step because of chunks of long prompts (over 256 tokens) (default "
                        "1.5; 0: no pacing, chunks bounded by --max-num-batched-tokens only)")
    p.add_argument("--max-pending", type=int, default=256,
                   help="requests in progress before new ones get 429 (default 256)")
    p.add_argument("--max-body-mb", type=int, default=16, help="JSON body limit (default 16)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take after SIGTERM (default 30)")
    p.add_argument("--batch-window", type=int, default=24 * 3600, metavar="SECONDS",
                   help="how long a batch may take before it expires (default 86400: the "
                   "'24h' completion window)")
    p.add_argument("--batch-max-running", type=int, default=16,
                   help="batch lines in the engine at once (default 16: measured best here)")
    p.add_argument("--price-input", type=float, default=0.10,
                   help="US$ per million prompt tokens, for /v1/usage (default 0.10)")
    p.add_argument("--price-output", type=float, default=0.40,
                   help="US$ per million completion tokens (default 0.40)")
    p.add_argument("--batch-discount", type=float, default=0.5,
                   help="discount on batch tokens, 0..1 (default 0.5)")
    p.add_argument("--grammar-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long a response_format or tools grammar may take to compile "
                   "before the request gets a 400 (default 10)")
    p.add_argument("--generation-config", default="auto", choices=("auto", "vllm", "none"),
                   help="auto (default): a request that leaves temperature, top_p, top_k, "
                   "min_p or repetition_penalty out gets the model's recommended value (its "
                   "generation_config.json, or the catalogue's); vllm or none: the API's "
                   "defaults (temperature 1, top_p 1)")
    p.add_argument("--reasoning-format", default="auto",
                   choices=REASONING_CHOICES,
                   help="the thinking block's tags: auto (default: from the chat template), "
                   "none (never split off), think (<think>...</think>), mistral "
                   "([THINK]...[/THINK]), gemma (<|channel>thought...<channel|>) or harmony "
                   "(gpt-oss's analysis channel)")
    p.add_argument("--tool-format", default="auto",
                   choices=TOOL_FORMATS,
                   help="how the model writes tool calls: auto (default: from the chat "
                   "template), or a family's format")
    p.add_argument("--max-reasoning-tokens", type=int, default=None, metavar="N",
                   help="the most tokens a thinking block may take unless a request says "
                   "(max_reasoning_tokens, thinking.budget_tokens); then the engine closes it "
                   "and the answer follows (default: no limit)")
    p.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS",
                   help="how long a model loaded on demand (a request named another stored "
                   "model) stays after its last request; -1: for good (default 300)")
    p.add_argument("--memory-limit", type=int, default=None, metavar="MB",
                   help="what the loaded models may hold together, weights and KV pools; a "
                   "load past it lets idle models go first (default: 80%% of the machine's "
                   "memory)")
    p.add_argument("--pin", action="append", default=None, metavar="NAME",
                   help="a model never let go once loaded (repeatable)")
    p.add_argument("--route", action="append", default=None,
                   metavar="NAME=SMALL,LARGE[,CONFIDENCE]",
                   help="a name requests may put in `model`: SMALL answers, and LARGE where "
                   "SMALL's confidence in its answer (the geometric mean probability of its "
                   "tokens) is below CONFIDENCE (default 0.5); two stored models sharing a "
                   "tokenizer (repeatable)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the model (default: torch's, one per core)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: auto")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--store", default=os.environ.get("LOCALSERVE_STORE") or None,
                   metavar="URL", help="a PostgreSQL database the replicas of a fleet share "
                   "(postgresql://USER@HOST:PORT/DATABASE; default $LOCALSERVE_STORE, else "
                   "the SQLite file in the home; docs/fleet.md)")
    p.add_argument("--stale-seconds", type=float, default=30.0, metavar="SECONDS",
                   help="a replica of a fleet silent this long is gone: the others take its "
                   "batch lines and fail its background responses (default 30)")
    p.set_defaults(func=run)


# Settings fields -> (the flag that sets them, the argparse attribute holding what was given).
FLAGS = {
    "max_num_seqs": ("--max-num-seqs", "max_num_seqs"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "max_num_batched_tokens"),
    "max_model_len": ("--max-model-len", "max_model_len"),
    "kv_cache_bytes": ("--kv-cache-mb", "kv_cache_mb"),
    "prefix_cache_bytes": ("--prefix-cache-mb", "prefix_cache_mb"),
    "idle_release_seconds": ("--idle-release-seconds", "idle_release_seconds"),
    "idle_cache_bytes": ("--idle-cache-mb", "idle_cache_mb"),
    "max_itl_stretch": ("--max-itl-stretch", "max_itl_stretch"),
    "max_pending": ("--max-pending", "max_pending"),
    "max_body_bytes": ("--max-body-mb", "max_body_mb"),
    "drain_timeout": ("--drain-timeout", "drain_timeout"),
    "threads": ("--threads", "threads"),
    "batch_window_seconds": ("--batch-window", "batch_window"),
    "batch_max_running": ("--batch-max-running", "batch_max_running"),
    "api_keys": ("--api-key", None),
    "cors_origins": ("--allow-origin", None),
    "input_per_million": ("--price-input", "price_input"),
    "output_per_million": ("--price-output", "price_output"),
    "batch_discount": ("--batch-discount", "batch_discount"),
    "grammar_timeout": ("--grammar-timeout", "grammar_timeout"),
    "max_reasoning_tokens": ("--max-reasoning-tokens", "max_reasoning_tokens"),
    "keep_alive": ("--keep-alive", "keep_alive"),
    "memory_limit": ("--memory-limit", "memory_limit"),
    "routes": ("--route", None),
    "store": ("--store", None),
    "stale_seconds": ("--stale-seconds", "stale_seconds"),
}


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:  # (flags checked before the server's modules load: 2.5 s)
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    routes = _routes(args.route or ())
    from server.api.app import create_app
    from server.api.state import ServerSettings, ServerState
    from server.api.usage import Prices
    from server.engine.engine import ConfigError, EngineConfig
    from server.models.device import DTYPES, pick_device

    pick_device(args.device)  # a device that cannot serve fails here, not after the bind
    _log_to_stderr(args.log_level)
    from server.engine.engine import limit_malloc_arenas

    limit_malloc_arenas()
    keys = tuple(args.api_key or [k for k in os.environ.get("LOCALSERVE_API_KEY", "").split(",")
                                  if k])
    try:  # the settings check themselves; an error names its flag
        settings = ServerSettings(
            model=(args.name or [DEFAULT_MODEL])[0], api_keys=keys,
            max_pending=args.max_pending,
            max_body_bytes=args.max_body_mb << 20, drain_timeout=args.drain_timeout,
            engine=EngineConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                kv_cache_bytes=None if args.kv_cache_mb is None else args.kv_cache_mb << 20,
                enable_prefix_caching=not args.no_prefix_caching,
                kv_cache_dtype=DTYPES[args.kv_cache_dtype] if args.kv_cache_dtype else None,
                max_itl_stretch=args.max_itl_stretch or None,
                prefix_cache_bytes=args.prefix_cache_mb << 20,
                idle_release_seconds=args.idle_release_seconds or None,
                idle_cache_bytes=args.idle_cache_mb << 20, recache_replies_after=0.5),
            device=args.device, dtype=args.dtype, threads=args.threads, store=args.store,
            stale_seconds=args.stale_seconds,
            prices=Prices(args.price_input, args.price_output, args.batch_discount),
            batch_window_seconds=args.batch_window,
            batch_max_running=args.batch_max_running, grammar_timeout=args.grammar_timeout,
            cors_origins=tuple(args.allow_origin or ()),
            generation_config=args.generation_config,
            reasoning_format=args.reasoning_format,
            max_reasoning_tokens=args.max_reasoning_tokens, tool_format=args.tool_format,
            keep_alive=None if args.keep_alive < 0 else args.keep_alive,
            pinned=tuple(args.pin or ()),
            memory_limit=default_memory_limit() if args.memory_limit is None
            else args.memory_limit << 20,
            routes=routes)
    except ConfigError as e:
        flag, value = FLAGS.get(e.field, (e.field, None))
        given = f", got {getattr(args, value)}" if value else ""
        message = e.message.split(", got")[0]
        raise ValueError(f"{flag} {message}{given}") from None
    name, *more = [_model_name(n) for n in args.name or [None]]
    check_routes(None, settings.routes)
    settings = replace(settings, model=name, preload=tuple(more),
                       pinned=settings.pinned + tuple(more))
    # The engine thread and the event loop share the GIL; a short switch interval keeps the
    # engine from waiting on the loop (measured: decode steps 61 -> 53 ms at one client).
    sys.setswitchinterval(0.0005)
    state = ServerState(settings)  # takes the home's database (one server per home)
    try:
        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"localserve: serving {name} at http://{shown}:{port}/v1 (loading the model...)",
              file=sys.stderr, flush=True)
        if (warning := exposure_warning(host, keys)) is not None:
            log.warning(warning)
        config = uvicorn.Config(create_app(settings, state), log_level=args.log_level,
                                access_log=args.access_log, timeout_graceful_shutdown=5,
                                lifespan="on")
        DrainingServer(config, state, args.drain_timeout).run(sockets=[sock])
    finally:
        state.db.close()
    if state.load_error:
        print(f"localserve: error: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def _routes(given: list[str]) -> dict[str, Route]:
    """--route NAME=SMALL,LARGE[,CONFIDENCE] (repeatable) by name; the settings check each."""
    routes: dict[str, Route] = {}
    for text in given:
        name, _, parts = text.partition("=")
        small, large, *rest = [*(p.strip() for p in parts.split(",")), ""][:3]
        try:
            confidence = float(rest[0]) if rest and rest[0] else 0.5
        except ValueError:
            raise ValueError(f"--route {text}: CONFIDENCE must be a number from 0 to 1") \
                from None
        if name in routes or not small or not large or parts.count(",") > 2:
            raise ValueError(f"--route {text}: give NAME=SMALL,LARGE[,CONFIDENCE] (each NAME "
                             "once)")
        routes[name] = Route(small, large, confidence)
    return routes


def _model_name(name: str | None) -> str:
    """The stored name to serve; a catalogue model (the default among them) not stored yet is
    pulled first, at the bits its tag names (4 without one)."""
    from storage.models import TAGS, ModelNotFoundError, ModelStore
    from storage.sources import CATALOGUE

    store = ModelStore()
    try:
        return store.resolve(name or DEFAULT_MODEL).name
    except ModelNotFoundError:
        alias, _, tag = (name or DEFAULT_MODEL).partition(":")
        bits = {t: b for b, t in TAGS.items()}.get(tag or "int4")
        if alias not in CATALOGUE or bits is None:
            raise ModelNotFoundError(f"model {name!r} is not in the store; pull it first: "
                                     f"localserve pull {name}") from None
    from cli.pull import pull

    print(f"localserve: {alias} is not in the store yet; pulling it at {bits} bits",
          file=sys.stderr, flush=True)
    return pull(alias, bits, store).name


def exposure_warning(host: str, api_keys: tuple[str, ...]) -> str | None:
    """A line for a server that other machines can reach with no key asked."""
    if api_keys or ipaddress.ip_address(host.split("%")[0]).is_loopback:
        return None
    return (f"listening on {host} without --api-key: anyone who can reach this machine can use "
            "the API, its files and batches")


def _bind(host: str, port: int) -> socket.socket:
    """Listen before loading, so a taken port fails in a second with one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with SIGTERM meaning "drain, then exit 0"."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.drain_deadline = 0.0

    def handle_exit(self, sig: int, frame) -> None:
        state = self.state
        if sig == signal.SIGTERM and not state.draining:
            state.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout
            log.warning("SIGTERM: draining %d request(s) and %d background response(s)",
                        state.num_http_inflight, state.num_background_running())
            return
        if sig == signal.SIGTERM:  # the second one: stop now, still exit 0
            self.should_exit = self.force_exit = True
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        state = self.state
        if state.draining and not self.should_exit and (
                state.num_http_inflight == 0 and not state.num_background_running()
                or time.monotonic() > self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)


def _log_to_stderr(level: str) -> None:
    """The server's own log lines (model ready and what its KV pool holds, batches) on stderr,
    beside uvicorn's."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("localserve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(level.upper())
        log.propagate = False
