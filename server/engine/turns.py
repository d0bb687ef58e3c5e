"""The turns the engines of the models a server holds take (api/held.py): one step at a time,
the most urgent work first. No torch."""

from __future__ import annotations

import threading


class StepTurns:
    """What the engines of the models a server holds share: the lock each step is taken under
    (they take turns, so their thread teams never compete for the cores), and how urgent each
    one's work is. Priorities hold across models as they do in one scheduler: an engine whose
    most urgent work is less urgent than another's (batch lines while another model streams
    to a user; a reply recomputed while another runs batch lines) waits until that is done,
    woken when it is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._urgency: dict[int, int] = {}  # engine id -> its most urgent work's priority
        self._wakes: dict[int, threading.Event] = {}

    def join(self, engine: object, wake: threading.Event) -> None:
        self._wakes[id(engine)] = wake

    def leave(self, engine: object) -> None:
        self.mark(engine, None)
        self._wakes.pop(id(engine), None)

    def mark(self, engine: object, urgency: int | None) -> None:
        """The engine's most urgent work now (None: none); the others wake when it eases."""
        key = id(engine)
        before = self._urgency.pop(key, None) if urgency is None else self._urgency.get(key)
        if urgency is not None:
            self._urgency[key] = urgency
        if before is not None and (urgency is None or urgency > before):
            for other, wake in list(self._wakes.items()):
                if other != key:
                    wake.set()

    def waits(self, engine: object, urgency: int) -> bool:
        """Another engine has more urgent work."""
        key = id(engine)
        return any(u < urgency for other, u in list(self._urgency.items()) if other != key)
