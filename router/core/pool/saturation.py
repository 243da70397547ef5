"""The engines' readings as they come: each replica's kept, its model's waiters let go, none kept past its age.

A part of the pool (router.core.pool.pool), as the cold starts and the
queues are: it holds the pool's collections by reference. A reading arrives
(`record`: from the engines' reader, or an answer's ORCA header), is kept on
its replica, makes its model's picks weigh the engines (its policy becomes
`aware`), and lets its model's waiters try again, since a replica may have
fallen below its bounds. A model saturated by readings asks (`saturated`)
for a check once the first of them goes stale: a reader that stopped (a
replica gone quiet, a broken /metrics) never leaves requests waiting on
readings no one renews.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from router.core.clock import Clock, Timer
from router.core.pool.fairness import Lines
from router.core.pool.loads import EngineLoad, EngineView
from router.core.pool.policy import Policy
from router.core.pool.replicas import Replica


class EngineLoads:
    """The engines' readings of the pool's replicas, and what waits on them."""

    __slots__ = ("_candidates", "_checks", "_clock", "_hand_off", "_touched", "_waiting", "view")

    def __init__(
        self,
        view: EngineView,
        clock: Clock,
        candidates: Mapping[str, Policy[Replica]],
        waiting: Lines,
        touched: dict[Replica, None],
        *,
        hand_off: Callable[[str], None],
    ) -> None:
        """The pool's: its per-model policies, its lines of waiters, its marks for the usage tick, its hand-off."""
        self.view = view
        self._clock = clock
        self._candidates = candidates
        self._waiting = waiting
        self._touched = touched
        self._hand_off = hand_off
        # The stale-reading check of each model whose waiters wait on saturated engines.
        self._checks: dict[str, Timer] = {}

    def record(self, replica: Replica, waiting: float, running: float | None, kv: float | None, source: str) -> None:
        """A reading of `replica`'s engine: its picks weigh it, and its model's waiters may go.

        A reading is never a use: it changes no stamp of the usage map.
        """
        previous = replica.load
        if running is None and previous is not None:
            # vLLM's ORCA header says the queue and the KV cache only: the batch as last read.
            running = previous.running
        replica.load = EngineLoad(waiting, running, kv, self._clock.now(), replica.in_flight, source)
        # For the usage tick's records (what /api/v1/replicas shows of it); a reading is no use.
        self._touched[replica] = None
        candidates = self._candidates.get(replica.model)
        if candidates is not None:
            candidates.aware = True
        if self._waiting.get(replica.model):
            self._hand_off(replica.model)

    def saturated(self, model: str, candidates: Policy[Replica]) -> bool:
        """Whether every candidate of `model` is at its bounds by a fresh reading."""
        view = self.view
        if not candidates.aware or not all(view.saturated(replica) for replica in candidates):
            return False
        # Its waiters wait on readings: they must not outlive them.
        self._check_soon(model)
        return True

    def shares(self) -> dict[str, float]:
        """Per model whose engines report their load: the share of its ready replicas saturated now."""
        view = self.view
        return {
            model: sum(1 for r in candidates if view.saturated(r)) / len(candidates)
            for model, candidates in self._candidates.items()
            if candidates.aware and len(candidates)
        }

    def _check_soon(self, model: str) -> None:
        """Hand `model`'s waiters a replica once the first reading that saturates it goes stale."""
        if model in self._checks:
            return
        expiries = [e for r in self._candidates.get(model, ()) if (e := self.view.expires(r)) is not None]
        if not expiries:
            return

        def check() -> None:
            del self._checks[model]
            if self._waiting.get(model):
                self._hand_off(model)
            # Still waiting on fresh readings that saturate it: checked again at their end.
            candidates = self._candidates.get(model)
            if self._waiting.get(model) and candidates is not None:
                self.saturated(model, candidates)

        self._checks[model] = self._clock.call_at(min(expiries) + 0.001, check)
