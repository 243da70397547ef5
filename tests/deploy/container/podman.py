"""podman for the container tier: settings and storage of its own (.cache/containers), and a pod spec run by it.

`Podman.run_spec` takes a container of a rendered Deployment (tests/support/manifests.py)
and runs it as the kubelet would: the image and args, env (a secretKeyRef
from the secrets given), the named ports (published on 127.0.0.1), the
securityContext (user, read-only root, no new privileges, capabilities),
the volumes (a configMap as a read-only directory of its keys, an emptyDir
as a tmpfs), and the CPU and memory limits. Nothing of the spec is left
unread: a field this mapping does not know fails the test, so that the
manifests and the containers the tests run cannot drift apart.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.manifests import ROOT, Doc
from tests.support.waiting import polled


def fake_replica(image: str, *options: str) -> list[str]:
    """`podman run`'s arguments for the fake replica (router/tools/fake/) in the image: one place, for a rename."""
    return ["--entrypoint", "python", image, "-m", "router.tools.fake", "--host", "0.0.0.0", *options]


# What the mapping below reads of a container and of its pod; anything else in
# a rendered spec is a field the tier does not run as written, and fails.
CONTAINER_FIELDS = {
    "name", "image", "args", "command", "ports", "env", "readinessProbe", "livenessProbe", "startupProbe",
    "resources", "securityContext", "volumeMounts", "imagePullPolicy",
}  # fmt: skip
SECURITY_FIELDS = {
    "runAsNonRoot", "runAsUser", "runAsGroup", "allowPrivilegeEscalation", "readOnlyRootFilesystem",
    "capabilities", "seccompProfile",
}  # fmt: skip
# automountServiceAccountToken: no API server runs here, so nothing is mounted either way (the
# discovery overlays' routers run with their config less discovery); topologySpreadConstraints
# place pods over nodes, and here is one host.
POD_FIELDS = {
    "containers", "volumes", "terminationGracePeriodSeconds", "serviceAccountName", "automountServiceAccountToken",
    "topologySpreadConstraints",
}  # fmt: skip


def host_limits() -> tuple[int, int]:
    """nofile and nproc no higher than this host allows a container (runc refuses more, and nproc > pid_max)."""
    import resource

    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return nofile, nproc


class PodmanError(AssertionError):
    pass


class Podman:
    """The podman CLI with settings of its own: rootful, storage in .cache/containers, runc, the host's limits."""

    def __init__(self, home: Path = ROOT / ".cache" / "containers") -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        nofile, nproc = host_limits()
        runtime = 'runtime = "runc"\n' if shutil.which("runc") else ""
        (home / "containers.conf").write_text(
            "[containers]\n"
            f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
            "[engine]\n"
            # crun refuses a hybrid cgroup layout (v1 controllers, v2 mounted beside); runc runs there.
            f"{runtime}"
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            "[network]\n"
            # Names on a network (aardvark-dns) need netavark.
            'network_backend = "netavark"\n'
        )
        (home / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{home / "storage"}"\nrunroot = "{home / "run"}"\n'
        )
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(home / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(home / "storage.conf"),
        }

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise PodmanError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def inspect(self, name: str) -> dict[str, Any]:
        info: dict[str, Any]
        (info,) = json.loads(self("inspect", "--type", "container", name).stdout)
        return info

    def logs(self, name: str) -> str:
        done = self("logs", name, check=False)
        return done.stdout + done.stderr

    def wait(self, name: str, timeout: float) -> int:
        return int(self("wait", name, timeout=timeout).stdout.split()[0])

    def remove(self, *names: str) -> None:
        if names:
            self("rm", "--force", "--time", "0", *names, check=False)


@dataclass
class Running:
    """A container started from a spec: its name, its named ports on the host, its grace."""

    name: str
    ports: dict[str, int]
    container: Doc
    grace: float
    mounts: Path
    env: dict[str, str] = field(default_factory=dict)

    def url(self, port: str) -> str:
        return f"http://127.0.0.1:{self.ports[port]}"

    def probe(self, which: str) -> int:
        """The probe's HTTP status, as the kubelet calls it: GET on the named port, a 1-second timeout."""
        spec = self.container[which]["httpGet"]
        port = spec["port"] if isinstance(spec["port"], int) else self.ports[spec["port"]]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{spec['path']}", timeout=1) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code
        except OSError:
            return 0


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity.removesuffix(suffix)) * factor)
    return int(quantity)


def cpus(quantity: str) -> str:
    return str(int(quantity.removesuffix("m")) / 1000) if quantity.endswith("m") else quantity


def run_spec(
    podman: Podman,
    docs: list[Doc],
    deployment: str,
    *,
    name: str,
    network: str,
    aliases: tuple[str, ...] = (),
    secrets: dict[tuple[str, str], str],
    workdir: Path,
    drop_volumes: tuple[str, ...] = (),
    files: dict[str, dict[str, str]] | None = None,
) -> Running:
    """Start the one container of `deployment`'s pod, as written; `files` replaces a configMap volume's keys.

    `drop_volumes` leaves named volumes out, to show what the spec's volume is for.
    """
    (template,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == deployment]
    pod = template["spec"]["template"]["spec"]
    unknown = set(pod) - POD_FIELDS
    assert not unknown, f"pod fields the container tier does not run: {unknown}"
    (container,) = pod["containers"]
    unknown = set(container) - CONTAINER_FIELDS
    assert not unknown, f"container fields the container tier does not run: {unknown}"
    argv = ["run", "--detach", "--pull", "never", "--name", name, "--hostname", name, "--network", network]
    for alias in aliases:
        argv += ["--network-alias", alias]
    if "command" in container:
        (entrypoint, *rest) = container["command"]
        argv += ["--entrypoint", entrypoint]
        assert not rest, "a command with arguments: put them in args"
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
    for key in env:
        # The value from the environment given to podman: not on its command line.
        argv += ["--env", key]
    for port in container.get("ports", []):
        # No host port: podman takes a free one, read back once the container runs.
        argv += ["--publish", f"127.0.0.1::{port['containerPort']}"]
    limits = container.get("resources", {}).get("limits", {})
    if "cpu" in limits:
        argv += ["--cpus", cpus(str(limits["cpu"]))]
    if "memory" in limits:
        argv += ["--memory", str(memory_bytes(str(limits["memory"])))]
    security = container.get("securityContext", {})
    unknown = set(security) - SECURITY_FIELDS
    assert not unknown, f"securityContext fields the container tier does not run: {unknown}"
    if "runAsUser" in security:
        argv += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"]
    if security.get("runAsNonRoot"):
        assert security.get("runAsUser", 1) != 0
    if security.get("readOnlyRootFilesystem"):
        # Kubernetes mounts nothing writable unasked; podman's --read-only adds tmpfs mounts unless told not to.
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if security.get("allowPrivilegeEscalation") is False:
        argv += ["--security-opt", "no-new-privileges"]
    for cap in security.get("capabilities", {}).get("drop", []):
        argv += ["--cap-drop", cap]
    for cap in security.get("capabilities", {}).get("add", []):
        argv += ["--cap-add", cap]
    assert security.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = workdir / name
    for mount in container.get("volumeMounts", []):
        if mount["name"] in drop_volumes:
            continue
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = mounts / mount["name"]
            source.mkdir(parents=True, exist_ok=True)
            source.chmod(0o755)
            config_map = (files or {}).get(mount["name"])
            if config_map is None:
                (doc,) = [
                    d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]
                ]
                config_map = doc["data"]
            for key, text in config_map.items():
                (source / key).write_text(text)
                (source / key).chmod(0o644)
            readonly = ":ro" if mount.get("readOnly") else ""
            argv += ["--volume", f"{source}:{mount['mountPath']}{readonly}"]
        elif "emptyDir" in volume:
            size = volume["emptyDir"].get("sizeLimit")
            options = f",tmpfs-size={memory_bytes(size)}" if size else ""
            argv += ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777{options}"]
        else:
            raise AssertionError(f"a volume the container tier does not run: {volume}")
    argv += [container["image"], *container.get("args", [])]
    podman.env.update(env)
    try:
        podman(*argv)
    finally:
        for key in env:
            podman.env.pop(key, None)
    ports = {}
    for port in container.get("ports", []):
        published = podman("port", name, f"{port['containerPort']}/tcp").stdout.split()[0]
        ports[port["name"]] = int(published.rsplit(":", 1)[1])
    return Running(name, ports, container, float(pod.get("terminationGracePeriodSeconds", 30)), mounts, env)


def wait_ready(podman: Podman, running: Running, probe: str = "readinessProbe", timeout: float = 60) -> None:
    """Until the probe answers 200, as the kubelet waits for a pod to be ready; the logs if it exits first."""

    def passed() -> bool:
        if running.probe(probe) == 200:
            return True
        state = podman.inspect(running.name)["State"]
        if not state["Running"]:
            raise PodmanError(f"{running.name} exited {state['ExitCode']}: {podman.logs(running.name)}")
        return False

    # Polled, as the kubelet polls a probe.
    if not polled(passed, timeout=timeout, every=0.1):
        raise PodmanError(f"{running.name} never passed its {probe}: {podman.logs(running.name)}")
