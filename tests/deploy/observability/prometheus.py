"""A real Prometheus (Debian's package) in a test's own folder, on a loopback port, and its HTTP API.

Its scrape config is deploy/prometheus/prometheus.yml itself, with each
job's service discovery replaced by the test's targets and the intervals
shortened: the shipped job names and relabelling are what the dashboard's
and the rules' queries meet.
"""

from __future__ import annotations

import copy
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
import yaml

from tests.support.programs import program
from tests.support.waiting import until, wait_for

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def scrape_config(targets: Mapping[str, Sequence[str]], rule_file: str, interval: str = "1s") -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with `targets` per job name instead of its DNS, every `interval`."""
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text()))
    config["global"] = {"scrape_interval": interval, "evaluation_interval": interval}
    config["rule_files"] = [rule_file]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(targets), f"the shipped jobs are {sorted(jobs)}"
    for name, job in jobs.items():
        for key in [k for k in job if k.endswith("_sd_configs")]:
            del job[key]
        job["static_configs"] = [{"targets": list(targets[name])}]
    return config


# Prometheus' line once its web port listens (the exporter toolkit's, at info).
LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


class Prometheus:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.url = ""
        self.process: subprocess.Popen[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._log: BinaryIO | None = None

    async def start(self, config: dict[str, Any], rules: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        (self.folder / config["rule_files"][0]).write_text(yaml.safe_dump(rules))
        # Closed in stop(), once the process no longer writes to it.
        self._log = (self.folder / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                program("prometheus"),
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                # Port 0: the log's "Listening on" line names the port (at info, hence the level).
                "--web.listen-address=127.0.0.1:0",
                "--log.level=info",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        self._session = aiohttp.ClientSession()
        deadline = time.monotonic() + 30
        process = self.process

        def said() -> bool:
            # Its log is a file: nothing to await but the next look.
            assert process.poll() is None, self.log()
            match = LISTENING.search((self.folder / "prometheus.log").read_text(errors="replace"))
            if match is not None:
                self.url = f"http://{match.group(1)}"
            return bool(self.url)

        await wait_for(said, timeout=30)
        session = self._session

        async def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log()
            try:
                async with session.get(self.url + "/-/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await until(ready, timeout=max(1.0, deadline - time.monotonic()), what="prometheus did not become ready")

    def log(self) -> str:
        path = self.folder / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    async def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>: its `data`; an AssertionError with Prometheus' own error when it refuses."""
        assert self._session is not None
        async with self._session.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            doc = await resp.json()
        assert doc.get("status") == "success", f"{path} {params}: {doc.get('errorType')}: {doc.get('error')}"
        return doc["data"]

    async def targets_up(self) -> dict[str, str]:
        """Each scraped target's job/instance and its health ('up', 'down' or 'unknown' before its first scrape)."""
        data = await self.api("targets")
        return {f"{t['labels']['job']}/{t['labels']['instance']}": t["health"] for t in data["activeTargets"]}

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
