"""What the exporters keep of the usage snapshots, kept current from each snapshot's changes.

GET /api/v1/usage, the push, /metrics's quiet series and the request rates
all read, per replica id, the newest stamp, the latest watch and the model
(what `UsageSnapshot.maps()` computes from a whole snapshot), or per model
the requests. `UsageMaps` follows the published snapshots once for all of
them, updating what the changed records touch, so that a tick costs what
changed. Each exporter then applies the same step to its own bytes; one
that missed a step (it raised, or joined late) rebuilds from the whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from router.core.pool.replicas import SLEEPING, sleep_state
from router.core.usage.records import Follower
from router.core.usage.snapshots import ReplicaUsage, UsageSnapshot

Key = Hashable
# A record that changed: its key, what it was (None: new) and what it is (None: gone).
Change = tuple[Key, ReplicaUsage | None, ReplicaUsage | None]


class UsageMaps:
    """Per replica id: `last_used`, `watching_since`, `model`, `horizon`, `asleep`; per model, `requests`."""

    __slots__ = (
        "asleep",
        "horizon",
        "last_used",
        "model",
        "moved",
        "requests",
        "steps",
        "watching_since",
        "_changes",
        "_follower",
        "_key_of",
        "_snapshot",
        "_twins",
    )

    def __init__(self) -> None:
        self._follower: Follower[ReplicaUsage] = Follower()
        # The key of each id's record; for an id with two (while it is replaced: its URL or
        # model changed, the old one draining), the keys of both, in the order they came.
        self._key_of: dict[str, Key] = {}
        self._twins: dict[str, dict[Key, None]] = {}
        self.last_used: dict[str, float] = {}
        self.watching_since: dict[str, float] = {}
        self.model: dict[str, str] = {}
        # The ids asleep or waking (the sleep tier), and which: UsageSnapshot.asleep_map()'s rule.
        self.asleep: dict[str, str] = {}
        # max(last_used, watching_since): the proven quiet time is generated_at less this.
        self.horizon: dict[str, float] = {}
        # Requests per model over the records of the newest snapshot (the rates' points).
        self.requests: dict[str, int] = {}
        # Snapshots followed: an exporter that applied step n - 1 may apply step n.
        self.steps = 0
        # The maps whose values the last step moved.
        self.moved: set[str] = set()
        self._snapshot: UsageSnapshot | None = None
        self._changes: list[Change] = []

    @property
    def records(self) -> Mapping[Key, ReplicaUsage]:
        """Every record of the newest snapshot followed, by key."""
        return self._follower.records

    def follow(self, snapshot: UsageSnapshot) -> list[Change]:
        """Take `snapshot` (once: the same step for every exporter); its changed records (key, before, after)."""
        if snapshot is self._snapshot:
            return self._changes
        changes = self._follower.follow(snapshot.book, snapshot.seq, snapshot.changes, snapshot.keyed())
        # A key names one replica (id, URL, model) for good; should one come back
        # naming another, it is the first one gone and another new.
        if any(b is not None and a is not None and (b.id, b.model) != (a.id, a.model) for _, b, a in changes):
            changes = [
                part
                for key, b, a in changes
                for part in (
                    ((key, b, None), (key, None, a))
                    if b is not None and a is not None and (b.id, b.model) != (a.id, a.model)
                    else ((key, b, a),)
                )
            ]
        requests = self.requests
        key_of, twins = self._key_of, self._twins
        self.moved = set()
        ids: set[str] = set()
        last_used_of, watching_of, horizon_of = self.last_used, self.watching_since, self.horizon
        for key, before, after in changes:
            if before is not None and after is not None and after.id not in twins:
                # The usual change: a replica's only record moved (its stamp, its counts).
                # Its maps from it alone, written out: every replica may have moved.
                rid, model = after.id, after.model
                if after.requests != before.requests:
                    total = requests.get(model, 0) + after.requests - before.requests
                    if total:
                        requests[model] = total
                    else:
                        requests.pop(model, None)
                stamp, watching = after.last_used, after.watching_since
                if stamp != before.last_used:
                    if stamp is None:
                        last_used_of.pop(rid, None)
                    else:
                        last_used_of[rid] = stamp
                    self.moved.add("last_used")
                if watching != before.watching_since:
                    watching_of[rid] = watching
                    self.moved.add("watching_since")
                horizon_of[rid] = stamp if stamp is not None and stamp > watching else watching
                if after.state != before.state:
                    self._sleep_state(rid, after.state)
                continue
            if before is not None:
                left = requests.get(before.model, 0) - before.requests
                if left:
                    requests[before.model] = left
                else:
                    requests.pop(before.model, None)
                rid = before.id
            if after is not None:
                requests[after.model] = requests.get(after.model, 0) + after.requests
                rid = after.id
                if before is None:
                    # A new record: the id's first, or its second while it is replaced.
                    known = key_of.get(rid)
                    if known is None and rid not in twins:
                        key_of[rid] = key
                    else:
                        keys = twins.get(rid)
                        if keys is None:
                            keys = twins[rid] = {known: None}
                            del key_of[rid]
                        keys[key] = None
            else:
                keys = twins.get(rid)
                if keys is None:
                    del key_of[rid]
                else:
                    del keys[key]
                    if len(keys) == 1:
                        (key_of[rid],) = keys
                        del twins[rid]
            ids.add(rid)
        # Once the step's records are all in: an id's two records may change in one step.
        for rid in ids:
            self._settle(rid)
        self.steps += 1
        self._snapshot = snapshot
        self._changes = changes
        return changes

    def _settle(self, rid: str) -> None:
        """One id's maps from its records, by UsageSnapshot.maps()'s rule."""
        records = self._follower.records
        moved = self.moved
        key = self._key_of.get(rid)
        if key is not None:
            # The usual case: one record per id.
            only = records[key]
            last_used, watching, model = only.last_used, only.watching_since, only.model
            self._sleep_state(rid, only.state)
        elif rid in self._twins:
            last_used = None
            first = True
            self._sleep_state(rid, sleep_state(records[twin].state for twin in self._twins[rid]))
            for twin in self._twins[rid]:
                r = records[twin]
                if r.last_used is not None and (last_used is None or r.last_used > last_used):
                    last_used = r.last_used
                if first or r.watching_since > watching:
                    watching = r.watching_since
                    model = r.model
                    first = False
        else:
            if self.last_used.pop(rid, None) is not None:
                moved.add("last_used")
            self._sleep_state(rid, "")
            del self.watching_since[rid]
            del self.model[rid]
            del self.horizon[rid]
            moved.update(("watching_since", "model"))
            return
        if last_used is None:
            if self.last_used.pop(rid, None) is not None:
                moved.add("last_used")
        elif self.last_used.get(rid) != last_used:
            self.last_used[rid] = last_used
            moved.add("last_used")
        if self.watching_since.get(rid) != watching:
            self.watching_since[rid] = watching
            moved.add("watching_since")
        if self.model.get(rid) != model:
            self.model[rid] = model
            moved.add("model")
        self.horizon[rid] = last_used if last_used is not None and last_used > watching else watching

    def _sleep_state(self, rid: str, state: str) -> None:
        """`rid` asleep or waking (`state`), or neither (any other state, or "": gone)."""
        if state in SLEEPING:
            if self.asleep.get(rid) != state:
                self.asleep[rid] = state
                self.moved.add("asleep")
        elif self.asleep.pop(rid, None) is not None:
            self.moved.add("asleep")
