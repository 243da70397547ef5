"""routing = "prefix" with prefix_placement = "learned": each prompt prefix's replicas learned from the load.

A hash places prefixes at random, and a model with a few popular system prompts finds two
of them on one replica as often as not; the bounded load then spills them to replicas that
have never seen them, each spill a prefill of the whole prompt. Here a prefix's first request
goes where the load is least, so the popular prompts start on different replicas, and its
later requests go back to the replicas it was sent to, whose prefix caches hold it: the least
loaded of them with room. Once the engines are read, one whose engine queues nothing has
room above the bounded load too: its batch takes the request in at once, where a replica that
never saw the prompt prefills it whole. Only when none has room does the least loaded of all
take one, and join the prefix's replicas (up to prefix_replicas of them, where set). What a
router learned is its own: another router, or this one restarted, places a prefix anew.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from typing import Any, Final, TypeVar

from router.core.pool.picking import AFFINITY_OUTCOMES, BoundedLoads, PolicySettings

T = TypeVar("T", bound=Hashable)

# The prefixes a model's policy remembers (each an 8-byte key and a short list), the least
# recently used forgotten first.
LEARNED_PREFIXES = 16_384

_HIT: Final = AFFINITY_OUTCOMES.index("hit")
_SPILL: Final = AFFINITY_OUTCOMES.index("spill")
_NONE: Final = AFFINITY_OUTCOMES.index("none")


class LearnedPrefixes(BoundedLoads[T]):
    """Prefix keys to the replicas they were sent to, each taking a key's request under BoundedLoads' bound.

    Once the model's engines are read (`aware`), a key's replica also takes it above the
    bound while a fresh reading says nothing waits in its engine (EngineView.takes); never
    when its engine is saturated. A request without a key, and a retry, goes to the least
    loaded candidate, as with least_loaded.
    """

    __slots__ = ("_learned", "_limit", "_takes")

    def __init__(self, rng: random.Random | None = None, settings: PolicySettings | None = None) -> None:
        super().__init__(rng, settings)
        settings = settings or PolicySettings()
        self._takes = settings.takes
        # prefix_replicas: the most replicas a prefix joins (0: as many as its load needs).
        self._limit = settings.spread
        # Per prefix key, the replicas it was sent to; the most recently used prefix last (a dict
        # keeps its order of insertion, and a pick takes its key out and puts it back).
        # A prefix's replica that is gone is dropped from its list when the prefix next spills.
        self._learned: dict[Any, list[T]] = {}

    def pick(self, key: Any = None) -> T | None:
        """The least loaded of the key's replicas with room; else the least loaded of all, which
        joins them; least loaded without a key."""
        if key is None or not self._slots:
            if key is None:
                self._outcomes[_NONE] += 1
            return super().pick()
        learned = self._learned
        replicas = learned.pop(key, None)
        if replicas is None:
            # A prefix first seen: where it goes becomes its own replica, a hit.
            chosen = super().pick()
            if chosen is None:
                # Every engine saturated: the pool's to hold the request.
                return None
            self._outcomes[_HIT] += 1
            learned[key] = [chosen]
            if len(learned) > LEARNED_PREFIXES:
                del learned[next(iter(learned))]
            return chosen
        learned[key] = replicas
        slots = self._slots
        capacity = self.capacity()
        judge = self._judge if self.aware else None
        # Once the engines are read, a replica of the prefix whose engine queues nothing has room
        # above the bound too: its batch takes the request in at once, where one that never saw
        # the prompt prefills it whole (below the per-replica limit, where set).
        takes = self._takes if judge is not None else None
        limit = self._per_replica
        best = math.inf
        found: T | None = None
        for replica in replicas:
            slot = slots.get(replica)
            if slot is None:
                continue
            if slot[0] < capacity or (takes is not None and takes(replica) and not (limit and slot[0] >= limit)):
                score = judge(replica) if judge is not None else float(slot[0])
                if score < best:
                    best, found = score, replica
        if found is not None:
            self._outcomes[_HIT] += 1
            return found
        # None of them with room: the least loaded of all, one of the prefix's replicas from now on.
        chosen = super().pick()
        if chosen is None:
            return None
        self._outcomes[_SPILL] += 1
        if chosen not in replicas:
            # Those gone (ejected, removed) make room for the one it goes to now.
            replicas[:] = [replica for replica in replicas if replica in slots]
            if not self._limit or len(replicas) < self._limit:
                replicas.append(chosen)
        return chosen

    def learned(self, key: Any) -> list[T]:
        """The replicas `key` was sent to (none: it was not, or is forgotten)."""
        return list(self._learned.get(key, ()))

    def learned_keys(self) -> list[Any]:
        """The keys remembered, the least recently used first."""
        return list(self._learned)
