"""Where the Kubernetes API is and how to reach it: found once at start, connected to by the watches.

In a cluster, the pod's service account; out of one, `kubeconfig`, then
$KUBECONFIG, then ~/.kube/config. The namespace, unless configured, is the
pod's own or the kubeconfig context's. `resolve_access` runs before
anything listens, so that a router that cannot find the API exits with one
line naming the key (`ConfigError`), as for any other mistake.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.config_exception import ConfigException

from router.core.config.settings import KubernetesDiscovery
from router.core.errors import ConfigError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True, slots=True)
class ApiAccess:
    """How to reach the API server, resolved once at start."""

    # None: in a cluster, with the pod's service account.
    kubeconfig: str | None
    namespace: str

    def describe(self) -> str:
        where = "the pod's service account" if self.kubeconfig is None else f"kubeconfig {self.kubeconfig}"
        return f"namespace {self.namespace} via {where}"

    async def connect(self) -> k8s.ApiClient:
        """A client of the API server; ConfigException when the credentials cannot be loaded."""
        configuration = k8s.Configuration()
        if self.kubeconfig is None:
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            await k8s_config.load_kube_config(
                config_file=self.kubeconfig, client_configuration=configuration, persist_config=False
            )
        return k8s.ApiClient(configuration=configuration)


def resolve_access(
    settings: KubernetesDiscovery, environ: Mapping[str, str], service_account: Path = SERVICE_ACCOUNT
) -> ApiAccess:
    """In a cluster its service account; else `kubeconfig`, $KUBECONFIG, ~/.kube/config. ConfigError if none."""
    key = "discovery.kubernetes"
    in_cluster = bool(environ.get("KUBERNETES_SERVICE_HOST")) and (service_account / "token").is_file()
    path: str | None = None
    if settings.kubeconfig is not None:
        path = os.path.expanduser(settings.kubeconfig)
        if not Path(path).is_file():
            raise ConfigError(f"{key}.kubeconfig: no such file: {settings.kubeconfig}")
    elif not in_cluster:
        candidates = [p for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p]
        home = environ.get("HOME")
        if not candidates and home:
            candidates = [os.path.join(home, ".kube", "config")]
        path = next((p for p in candidates if Path(p).is_file()), None)
        if path is None:
            raise ConfigError(
                f"{key}: no Kubernetes API to ask: not in a cluster (no KUBERNETES_SERVICE_HOST and service "
                f"account token), no kubeconfig key, and no file in $KUBECONFIG or ~/.kube/config"
            )
    namespace = settings.namespace
    if namespace is None:
        namespace = _own_namespace(path, service_account)
    return ApiAccess(kubeconfig=path, namespace=namespace)


def _own_namespace(kubeconfig: str | None, service_account: Path) -> str:
    """The pod's own namespace in a cluster; the kubeconfig context's out of one; else "default"."""
    if kubeconfig is None:
        try:
            return (service_account / "namespace").read_text().strip() or "default"
        except OSError:
            return "default"
    try:
        _, current = k8s_config.list_kube_config_contexts(kubeconfig)
    except (ConfigException, OSError, ValueError) as exc:
        raise ConfigError(f"discovery.kubernetes.kubeconfig: {kubeconfig}: {exc}") from exc
    context = (current or {}).get("context") or {}
    namespace = context.get("namespace") if isinstance(context, dict) else None
    return namespace if isinstance(namespace, str) and namespace else "default"
