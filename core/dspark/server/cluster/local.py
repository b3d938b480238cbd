"""A Ray cluster of several nodes on this machine's loopback: for tests, benchmarks and trying the cluster out.

Each node is a ``ray start --block`` process (its raylet and workers die with
it), so a node "leaves" by stopping that one process. Nodes differ by what they
declare (CPUs, custom resources) and by their environment (e.g.
``DSPARK_PLUGINS=no:npu`` gives a node without the npu plugin).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class LocalNode:
    proc: subprocess.Popen[bytes]
    resources: dict[str, float]
    log: Path
    left: bool = False

    def leave(self, timeout: float = 30.0) -> None:
        """Stop the node (SIGTERM: ``ray start --block`` drains it and takes its raylet and workers down)."""
        self.left = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@dataclass
class LocalCluster:
    """``start()`` a head; ``add_node()`` workers; ``stop()`` everything (also on garbage collection of the test)."""

    workdir: Path
    port: int = 6390
    host: str = "127.0.0.1"
    object_store_bytes: int = 100 * 2**20  # the engine's outputs are small; keep the RAM for the replicas
    nodes: list[LocalNode] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment of the nodes and of every client of this cluster (``dspark serve``, drivers).

        Token authentication is off: the nodes listen on loopback only, and a token would have to reach
        every client process too.
        """
        return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _start(self, args: list[str], num_cpus: float, resources: dict[str, float], env: dict[str, str] | None,
               name: str) -> LocalNode:
        log = self.workdir / f"{name}.log"
        cmd = [_ray_bin(), "start", "--block", "--node-ip-address", self.host, f"--num-cpus={num_cpus}",
               f"--resources={json.dumps(resources)}", f"--object-store-memory={self.object_store_bytes}",
               "--disable-usage-stats", *args]
        full_env = {**self.env, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        node = LocalNode(proc, resources, log)
        self.nodes.append(node)
        return node

    def start(self, num_cpus: float = 1, resources: dict[str, float] | None = None,
              env: dict[str, str] | None = None) -> LocalNode:
        self.workdir.mkdir(parents=True, exist_ok=True)
        node = self._start(["--head", f"--port={self.port}", "--include-dashboard=false"], num_cpus,
                           resources or {}, env, "head")
        self.wait_nodes(1)
        return node

    def add_node(self, num_cpus: float = 1, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None) -> LocalNode:
        node = self._start([f"--address={self.address}"], num_cpus, resources or {}, env, f"node{len(self.nodes)}")
        self.wait_nodes(sum(not n.left for n in self.nodes))
        return node

    def alive_nodes(self) -> int:
        """Live nodes, from ``ray status`` (the state API would need the dashboard, which these nodes do not run)."""
        out = subprocess.run([_ray_bin(), "status", "--address", self.address], capture_output=True, text=True,
                             timeout=60, env=self.env)
        active = out.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if out.returncode == 0 else ""
        return sum(line.strip().startswith("1 node_") for line in active.splitlines())

    def wait_nodes(self, n: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [nd for nd in self.nodes if not nd.left and nd.proc.poll() is not None]
            if dead:
                raise RuntimeError(f"a Ray node exited: {dead[0].log.read_text()[-2000:]}")
            if self.alive_nodes() == n:
                return
            time.sleep(1.0)
        raise TimeoutError(f"the local Ray cluster did not reach {n} live nodes in {timeout:.0f}s")

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.leave()
        self.nodes.clear()
