"""The models a server holds beside its first: any model in the store, loaded when a request
names it and let go when it has been idle past its keep-alive (`serve --keep-alive`; the
first, the one `serve` names, is held for good).

A request for such a model sees it as the server's state (ModelView: that model's engine,
tokenizer, grammars, reasoning format and limits, and everything else the server's: database,
queue, usage), so every route serves it unchanged. Loading runs in a worker thread under the
model's own lock (its requests wait for it; other models' streams go on). The engines of all
held models share one step lock (StepTurns): they take turns, a step at a time, so their
thread teams never compete for the cores, and one's own idle work waits for the others'
requests.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from typing import Any, NamedTuple

from server.api.errors import APIError, invalid, model_not_found
from server.api.metrics import ApiMetrics
from server.engine.turns import StepTurns

ServerState = Any  # server/api/state.py's, which holds these (it imports this module)

log = logging.getLogger("localserve")
GRACE = 1.0  # seconds
ROOM_WAIT = 30.0  # seconds a load waits for memory to free before it is refused
NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(:[A-Za-z0-9._-]+)?$")  # never a path


class ModelView:
    """The server's state as a request for one held model sees it."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self.engine: Any = None
        self.keep_alive: float | None = None  # a request's (Ollama's keep_alive), else serve's
        self.in_flight = 0  # admitted interactive requests (and routes' holds)
        self.loaded_at = self.last_used = time.monotonic()
        self.metrics = ApiMetrics()  # its requests' latencies and finishes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    def acquire(self) -> None:
        self._state.acquire()
        self.in_flight += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self._state.release()
        self.in_flight -= 1
        self.last_used = time.monotonic()

    # The server's model methods, on this model's fields
    def ready_engine(self) -> Any:
        return type(self._state).ready_engine(self)

    def serves(self, name: object) -> bool:
        return type(self._state).serves(self, name)

    def check_model(self, name: str) -> None:
        type(self._state).check_model(self, name)

    def check_generates(self) -> None:
        type(self._state).check_generates(self)

    @property
    def is_idle(self) -> bool:
        """No admitted request, nothing in its engine (batch lines hold no place there)."""
        return self.in_flight == 0 and not self.engine.output.requests


class Route(NamedTuple):
    """`serve --route NAME=SMALL,LARGE[,CONFIDENCE]`: SMALL answers; below CONFIDENCE (the
    geometric mean probability of its tokens) LARGE does (api/generation/cascade.py)."""

    small: str
    large: str
    confidence: float = 0.5


def hold(state: Any, n: int) -> None:
    """Count `n` more (or fewer) users of a held model: it is not let go while it has any."""
    if isinstance(state, ModelView):
        state.in_flight += n
        state.last_used = time.monotonic()


class RouteView:
    """A request naming a route (`serve --route NAME=SMALL,LARGE`) sees the small model's
    state (the large one shares its tokenizer and chat template: check_routes), holds both
    models while it runs, and answers as the model that answered (generation/cascade.py
    decides and names it)."""

    def __init__(self, route: str, small: Any, large: Any) -> None:
        self.route, self.small, self.large = route, small, large
        self.served_name = small.served_name  # until the cascade decides
        self.max_request_tokens = min(small.max_request_tokens, large.max_request_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.small, name)

    def acquire(self) -> None:
        self.small.acquire()
        hold(self.large, 1)

    def release(self) -> None:
        self.small.release()
        hold(self.large, -1)

    def ready_engine(self) -> Any:
        return _RouteEngine(self.route, self.small.ready_engine(), self.large.ready_engine())

    def serves(self, name: object) -> bool:
        return name == self.route

    def check_model(self, name: str) -> None:
        if not self.serves(name):
            raise model_not_found(name)

    def check_generates(self) -> None:
        self.small.check_generates()
        self.large.check_generates()


class _RouteEngine:
    """A route's engines as far as requests check them: a request fits if it fits both;
    nothing is embedded through a route."""

    def __init__(self, route: str, small: Any, large: Any) -> None:
        self.route, self.small, self.large = route, small, large

    def check(self, num_prompt_tokens: int, params: Any) -> None:
        self.small.check(num_prompt_tokens, params)
        self.large.check(num_prompt_tokens, params)

    def __getattr__(self, name: str) -> Any:
        if name in ("embed", "generate"):
            raise invalid("model", f"`{self.route}` is a route between two models: it answers "
                          "generating requests; name one of its models here.",
                          code="model_not_supported")
        return getattr(self.small, name)


def check_routes(home: Any, routes: dict[str, Route]) -> None:
    """Each route's models are in the store and share a tokenizer and chat template (one
    prompt's tokens serve both), and no stored model goes by the route's name; raises
    ValueError (one line) if not."""
    from storage.models import ModelNotFoundError, ModelStore, same_prompting

    store = ModelStore(home)
    stored = {n for m in store.list() for n in (m.name, m.name.split(":")[0])}
    for name, (small, large, _) in routes.items():
        if name in stored:
            raise ValueError(f"--route {name}: a stored model has that name; pick another")
        try:
            a, b = store.resolve(small), store.resolve(large)
        except ModelNotFoundError as e:
            raise ValueError(f"--route {name}: {e}") from None
        if not same_prompting(a, b):
            raise ValueError(f"--route {name}: {a.name} and {b.name} do not share a tokenizer "
                             "and chat template; a route's two models must (one family at two "
                             "sizes, or one model at two bits)")


def default_memory_limit() -> int | None:
    """Four fifths of the machine's memory (Linux's MemTotal), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 * 4 // 5
    except OSError:
        pass
    return None


def _give_back_memory() -> None:
    from server.engine.engine import collect_everything, release_freed_memory

    collect_everything()  # the engine let go was frozen with the rest (settle_heap)
    release_freed_memory()


class HeldModels:
    """The held models by name, loaded on demand, reaped when idle."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.views: dict[str, ModelView] = {}
        self.turns = StepTurns()  # every held engine's step lock, the first's included
        self._loading: dict[str, asyncio.Lock] = {}
        # a model was let go: collect and give memory back once more at the reaper's next round,
        # for a reference to its engine that outlived the let-go by a moment
        self._collect_again = False
        self.room_wait = ROOM_WAIT
        self.routed: Counter[tuple[str, str]] = Counter()  # (route, answering model) requests

    def find(self, name: Any) -> ServerState | ModelView | None:
        """The state that serves `name` now, if any (the first model's, or a held one's)."""
        state = self.state
        if state.engine is None or state.serves(name):
            return state
        for view in self.views.values():
            if view.serves(name):
                view.last_used = time.monotonic()
                return view
        return None

    async def view_for(self, name: Any) -> ServerState | ModelView | RouteView:
        """The state a request naming `name` runs on: loading the model if the store has it
        (both of a route's); 404 model_not_found if not (a name that is not a string is the
        parser's to refuse)."""
        if isinstance(name, str) and name in self.state.settings.routes:
            return await self._route(name)
        found = self.find(name)
        if found is not None or not isinstance(name, str):
            return found or self.state
        stored = self.stored(name)
        lock = self._loading.setdefault(stored.name, asyncio.Lock())
        async with lock:
            if stored.name not in self.views:
                await self._make_room(stored.size_bytes + self._kv_bytes())
                self.views[stored.name] = await self._load(stored)
        view = self.views[stored.name]
        view.last_used = time.monotonic()
        return view

    async def _route(self, name: str) -> RouteView:
        """A request's view of a route, both its models loaded (the small one held while the
        large one loads: making room never lets it go)."""
        small_name, large_name, _ = self.state.settings.routes[name]
        small = await self.view_for(small_name)
        hold(small, 1)
        try:
            large = await self.view_for(large_name)
        finally:
            hold(small, -1)
        return RouteView(name, small, large)

    def loaded_names(self) -> tuple[str, ...]:
        """The loaded models' names, full and bare (batch lines naming them go first)."""
        names = [self.state.served_name, *self.views] if self.state.engine is not None \
            else list(self.views)
        return tuple(n for name in names for n in (name, name.split(":")[0]))

    def keep(self, state: Any, seconds: float | None) -> None:
        """A request's keep-alive for its model (Ollama's semantics: 0 lets it go after this
        request, a negative one keeps it for good); the first model is held anyway."""
        if seconds is not None and isinstance(state, ModelView):
            state.keep_alive = seconds

    def pinned(self, view: ModelView) -> bool:
        """`serve --pin`: never let go."""
        return any(view.serves(name) for name in self.state.settings.pinned)

    def has(self, name: Any) -> bool:
        """The store holds a model `name` names, or it is a route (a batch line may name
        it)."""
        if isinstance(name, str) and name in self.state.settings.routes:
            return True
        try:
            return isinstance(name, str) and bool(self.stored(name))
        except Exception:  # noqa: BLE001 - model_not_found
            return False

    def stored(self, name: str) -> Any:
        """The stored model `name` names; 404 model_not_found if none."""
        from storage.models import ModelStore, ModelStoreError

        if not NAME.match(name):
            raise model_not_found(name)
        try:
            return ModelStore(self.state.home).resolve(name)
        except ModelStoreError:
            raise model_not_found(name) from None

    async def _load(self, stored: Any) -> ModelView:
        from server.engine.async_engine import load_engine
        from storage.sampling import sampling_defaults

        s = self.state.settings
        started = time.monotonic()
        engine = await asyncio.to_thread(load_engine, stored, s.engine, s.device, s.dtype,
                                         self.turns)
        defaults = {}
        if s.generation_config == "auto":
            defaults, _ = sampling_defaults(stored.path, stored.manifest.get("alias", ""))
        view = ModelView(self.state)
        type(self.state).attach(view, engine, stored.name, stored.manifest, defaults)
        view.metrics.load_seconds = time.monotonic() - started
        log.info("model %s loaded on demand in %.1f s", stored.name, view.metrics.load_seconds)
        return view

    async def reap(self, keep_alive: float | None, now: float | None = None) -> list[str]:
        """Let go of the models idle for longer than their keep-alive: a request's, else
        `keep_alive` seconds (None: never); pinned ones never."""
        now = time.monotonic() if now is None else now

        def expired(v: ModelView) -> bool:
            keep = keep_alive if v.keep_alive is None else v.keep_alive
            return keep is not None and keep >= 0 and now - v.last_used >= max(keep, GRACE)
        gone = [name for name, v in self.views.items() if v.is_idle and expired(v)
                and not self.pinned(v) and not self._loading[name].locked()]
        for name in gone:
            await self._let_go(name, f"after {now - self.views[name].last_used:.0f} s idle")
        return gone

    async def _let_go(self, name: str, why: str) -> None:
        view = self.views.pop(name)
        await asyncio.to_thread(view.engine.shutdown)
        view.engine = None  # its weights and KV pool go with it
        del view
        await asyncio.to_thread(_give_back_memory)
        self._collect_again = True
        log.info("model %s let go %s", name, why)

    async def unload(self, name: str) -> None:
        """Let `name` go now (POST /v1/models/{name}/unload): 400 for the first model, which
        is held for good; 409 while it has requests; 404 if it is not loaded."""
        if self.state.serves(name):
            raise APIError(400, f"The model `{name}` is the one this server was started with: "
                           "it stays loaded.", param="model")
        view = next((v for v in self.views.values() if v.serves(name)), None)
        if view is None:
            raise APIError(404, f"The model `{name}` is not loaded.", param="model",
                           code="model_not_loaded")
        if not view.is_idle:
            raise APIError(409, f"The model `{name}` has requests running; retry when they "
                           "end.", param="model", code="model_busy")
        await self._let_go(view.served_name, "on request")

    # -- memory ----------------------------------------------------------------------------

    def footprint(self, state: Any) -> int:
        """Bytes a loaded model holds: its stored files (the weights) and its KV pool."""
        engine = state.engine.engine  # sizes fixed at load: read from any thread
        kv = len(engine.block_manager.blocks) * engine.block_bytes
        return self._file_bytes(state.served_name) + kv

    def _file_bytes(self, name: str) -> int:
        try:
            return self.stored(name).size_bytes
        except Exception:  # noqa: BLE001 - a model served from outside the store
            return 0

    def _kv_bytes(self) -> int:
        """The KV pool a model loaded now would take (serve's setting, or the default)."""
        from server.engine.engine import default_kv_cache_bytes

        configured = self.state.settings.engine.kv_cache_bytes
        return configured if configured is not None else default_kv_cache_bytes("cpu")

    def used(self) -> int:
        held = [self.state] if self.state.engine is not None else []
        return sum(self.footprint(v) for v in [*held, *self.views.values()])

    async def _make_room(self, need: int) -> None:
        """Let go of idle models, least recently used first, until `need` more bytes fit
        `serve --memory-limit`; while none is idle, wait for one (at most room_wait), then
        503 Retry-After: never more than the limit, never an out-of-memory kill."""
        limit = self.state.settings.memory_limit
        deadline = time.monotonic() + self.room_wait
        while limit is not None and self.used() + need > limit:
            idle = sorted((v for n, v in self.views.items() if v.is_idle and not self.pinned(v)
                           and not self._loading[n].locked()), key=lambda v: v.last_used)
            if idle:
                await self._let_go(idle[0].served_name, "for room")
                continue
            if time.monotonic() >= deadline:
                raise APIError(503, f"Not enough memory to load another model: "
                               f"{need >> 20} MB needed, {self.used() >> 20} of "
                               f"{limit >> 20} MB held by models in use (serve "
                               "--memory-limit); retry when they are idle.",
                               code="model_memory", headers={"Retry-After": "5"})
            await asyncio.sleep(0.25)

    async def run_reaper(self) -> None:
        """Reap every second while the server runs."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if self._collect_again:
                    self._collect_again = False
                    await asyncio.to_thread(_give_back_memory)
                await self.reap(self.state.settings.keep_alive)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("letting go of idle models failed")

    async def close(self) -> None:
        for view in self.views.values():
            await asyncio.to_thread(view.engine.shutdown)
        self.views.clear()
