"""Where the replica set comes from: one interface for every source, one process or many.

A source gives the set to serve before the first client (`initial()`),
keeps it current while the router runs (`run()`: a watch, for discovery),
and re-reads it on SIGHUP (`reload()`). It changes the set only through a
`Fleet`, so the same source drives a single process's pool and the
supervisor of `--workers` (which fans each change out to every worker).
An `exclusive` source owns the whole set: endpoint pushes are refused
while it runs, so that two writers never fight over one set.

The sources: the config file's [[replicas]], or Kubernetes discovery
(router/control/discovery/: EndpointSlices, exclusive).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry

from router.control.fleet import Fleet, FleetUnavailable
from router.core.config.settings import Config, ReplicaConfig, load_config
from router.core.errors import ConfigError

log = logging.getLogger("router.control.sources")


class ReplicaSource(Protocol):
    """Where the replica set comes from (the config file, Kubernetes discovery): its first set, and its changes."""

    name: str
    # True when this source owns the whole set: PUT /api/v1/endpoints answers 409.
    exclusive: bool

    def initial(self) -> tuple[ReplicaConfig, ...]:
        """The set to serve before the first client arrives."""
        ...

    def ready(self) -> bool:
        """False until the source has applied its first set: /readyz answers 503 meanwhile."""
        ...

    def register(self, registry: CollectorRegistry) -> None:
        """Export the source's own metrics, where it runs (one process, or the supervisor)."""
        ...

    async def run(self, fleet: Fleet) -> None:
        """Keep the set current until cancelled; a source with nothing to watch returns at once."""
        ...

    async def reload(self, fleet: Fleet) -> bool:
        """SIGHUP: read the set again and apply it; False when nothing changed for an error."""
        ...


class ConfigFileSource:
    """The config file's [[replicas]]: read at start and again on SIGHUP."""

    name = "config file"
    exclusive = False

    def __init__(self, config: Config, path: str | None) -> None:
        self.config = config
        self.path = path

    def initial(self) -> tuple[ReplicaConfig, ...]:
        return self.config.replicas

    def ready(self) -> bool:
        return True

    def register(self, registry: CollectorRegistry) -> None:
        return

    async def run(self, fleet: Fleet) -> None:
        return

    async def reload(self, fleet: Fleet) -> bool:
        """An invalid file changes nothing. The replicas are reloaded here (the client keys by
        RouterServer.reload_keys); other settings need a restart."""
        if self.path is None:
            return False
        try:
            fresh = load_config(self.path)
        except ConfigError as exc:
            log.error("reload refused, nothing changed: %s", exc)  # noqa: TRY400 (the message says it all)
            return False
        try:
            diff = await fleet.set_replicas(fresh.replicas)
        except FleetUnavailable as exc:
            log.error("reload reached only some workers: %s", exc)  # noqa: TRY400 (the message says it all)
            return False
        log.info(
            "reloaded %s: %d added, %d removed, %d changed",
            self.path,
            len(diff["added"]),
            len(diff["removed"]),
            len(diff["changed"]),
        )
        if replace(fresh, replicas=(), api_keys=(), source="") != replace(
            self.config, replicas=(), api_keys=(), source=""
        ):
            log.warning("reload applied the replicas and api_keys only; other changed settings need a restart")
        return True


def build_sources(config: Config, config_path: str | None) -> list[ReplicaSource]:
    """The sources that `config` names, in the order their sets are merged.

    With [discovery.kubernetes] discovery alone: it owns the whole set, and
    the config file may hold no [[replicas]] then (config.py refuses both).
    Raises ConfigError when the API server's address cannot be found.
    """
    if config.discovery is not None:
        # Imported here: the Kubernetes client is loaded only where discovery is on.
        from router.control.discovery.access import resolve_access  # noqa: PLC0415
        from router.control.discovery.source import KubernetesSource  # noqa: PLC0415

        return [KubernetesSource(config.discovery, resolve_access(config.discovery, os.environ))]
    return [ConfigFileSource(config, config_path)]


def sources_ready(sources: list[ReplicaSource]) -> bool:
    return all(source.ready() for source in sources)


def initial_set(sources: list[ReplicaSource]) -> tuple[ReplicaConfig, ...]:
    return tuple(c for source in sources for c in source.initial())


def exclusive_source(sources: list[ReplicaSource]) -> str | None:
    """The name of the source that owns the set, if any: endpoint pushes are refused then."""
    return next((s.name for s in sources if s.exclusive), None)


async def reload_all(sources: list[ReplicaSource], fleet: Fleet) -> bool:
    ok = True
    for source in sources:
        ok = await source.reload(fleet) and ok
    return ok
