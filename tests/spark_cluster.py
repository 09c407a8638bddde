"""A Spark standalone cluster on this machine, for tests: one master and two workers,
each its own JVM started through pyspark's own launcher (``bin/spark-class``, which
``exec``s the JVM, so the process id is the JVM's), waited for through their logs and
ports, and stopped by process id. Each worker offers 1 core and a little memory, so
each executor of an application is its own JVM on its own worker with its own Python
workers. A Spark Connect server (``SparkConnectServer`` through ``spark-submit``) is
started the same way where a test needs one.

Addresses: the machine's routable address when it has one (so the runner's
off-loopback path, mutual TLS included, is what runs), else loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

START_TIMEOUT_S = 120.0
EXECUTOR_MEMORY = "512m"  # Spark's floor is 450 MiB
WORKER_MEMORY = "640m"


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def routable_host() -> str:
    """This machine's address on its default route (no packet is sent), else loopback."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.254", 9))  # TEST-NET: only the route is looked up
        host = str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
    try:  # reachable from here: something can listen on it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return "127.0.0.1"
    return host


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen
    log: Path

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for(self, marker: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.text():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        tail = "\n".join(self.text().splitlines()[-30:])
        raise RuntimeError(f"{self.name} did not report {marker!r} (exit code {self.process.poll()}):\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _env(root: Path, host: str, daemon: bool) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(
        SPARK_HOME=spark_home(),
        SPARK_LOCAL_IP=host,
        SPARK_LOCAL_DIRS=str(root / "local"),
        SPARK_LOG_DIR=str(root / "logs"),
        PYSPARK_PYTHON=sys.executable,
    )
    if daemon:  # the master and workers: their heaps (the Connect server is a driver, 512m)
        env["SPARK_DAEMON_MEMORY"] = "256m"
    return env


def _launch(name: str, args: List[str], root: Path, host: str, tool: str = "spark-class") -> Daemon:
    log = root / f"{name}.log"
    out = open(log, "wb")  # the daemon has its own copy of the descriptor
    process = subprocess.Popen(
        [os.path.join(spark_home(), "bin", tool), *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=_env(root, host, daemon=tool == "spark-class"),
        cwd=str(root),
        start_new_session=True,  # never in the test's process group: a Ctrl-C reaches pytest only
    )
    out.close()
    return Daemon(name, process, log)


@dataclass
class Cluster:
    host: str
    port: int
    root: Path
    master: Daemon
    workers: List[Daemon] = field(default_factory=list)
    connect: Optional[Daemon] = None
    connect_port: int = 0

    @property
    def url(self) -> str:
        return f"spark://{self.host}:{self.port}"

    def executor_pids(self) -> List[int]:
        """Process ids of the executor JVMs the workers run now."""
        workers = {w.process.pid for w in self.workers}
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if b"CoarseGrainedExecutorBackend" in cmdline and ppid in workers:
                pids.append(int(entry))
        return sorted(pids)

    def session_builder(self, app: str) -> Any:
        from pyspark.sql import SparkSession

        return (
            SparkSession.builder.master(self.url)
            .appName(app)
            .config("spark.driver.host", self.host)
            .config("spark.driver.bindAddress", self.host)
            .config("spark.executor.cores", "1")
            .config("spark.executor.memory", EXECUTOR_MEMORY)
            .config("spark.cores.max", str(len(self.workers)))
            .config("spark.pyspark.python", sys.executable)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            # A barrier stage waits for its slots (an executor being replaced) in 1 s steps.
            .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
            .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "120")
        )

    def wait_for_executors(self, spark: Any, count: Optional[int] = None, timeout: float = START_TIMEOUT_S) -> None:
        """Until ``count`` executors (default: one per worker) have registered with the driver."""
        count = len(self.workers) if count is None else count
        deadline = time.monotonic() + timeout
        tracker = spark.sparkContext._jsc.sc().statusTracker()
        while time.monotonic() < deadline:
            if len(tracker.getExecutorInfos()) - 1 >= count:  # the driver is listed too
                return
            time.sleep(0.2)
        raise RuntimeError(f"fewer than {count} executors registered in {timeout:.0f} s")

    def start_connect(self) -> str:
        """A Spark Connect server whose applications run on this cluster; its ``sc://`` URL."""
        self.connect, url = start_connect(self.root, self.url, self.host, cores_max=len(self.workers))
        return url

    def stop(self) -> None:
        for daemon in [*([self.connect] if self.connect else []), *self.workers, self.master]:
            daemon.stop()
        for pid in self.executor_pids():  # orphans of a worker that died first
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_cluster(root: Path, workers: int = 2) -> Cluster:
    """A master and ``workers`` workers (1 core each), every one registered."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "local").mkdir(exist_ok=True)
    host = routable_host()
    port = free_port(host)
    master = _launch(
        "master",
        ["org.apache.spark.deploy.master.Master", "--host", host, "--port", str(port), "--webui-port", "0"],
        root,
        host,
    )
    cluster = Cluster(host, port, root, master)
    try:
        master.wait_for("I have been elected leader")
        for i in range(workers):
            work = root / f"work-{i}"
            work.mkdir(exist_ok=True)
            worker = _launch(
                f"worker-{i}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    host,
                    "--cores",
                    "1",
                    "--memory",
                    WORKER_MEMORY,
                    "--webui-port",
                    "0",
                    "--work-dir",
                    str(work),
                    cluster.url,
                ],
                root,
                host,
            )
            cluster.workers.append(worker)
        for worker in cluster.workers:
            worker.wait_for("Successfully registered with master")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_connect(root: Path, master: str, host: Optional[str] = None, cores_max: int = 0) -> Tuple[Daemon, str]:
    """A Spark Connect server (``SparkConnectServer`` through ``spark-submit``: its own
    driver JVM) on ``master`` (``local[N]`` or a cluster's URL), listening on ``host``
    (default: the machine's routable address); it and its ``sc://`` URL once it listens."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "local").mkdir(exist_ok=True)
    host = host or routable_host()
    port = free_port(host)
    conf = {
        "spark.connect.grpc.binding.address": host,
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.host": host,
        "spark.driver.bindAddress": host,
        "spark.executor.cores": "1",
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.pyspark.python": sys.executable,
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "1s",
    }
    if cores_max:
        conf["spark.cores.max"] = str(cores_max)
    args = ["--master", master, "--driver-memory", "512m"]
    args += ["--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    for k, v in conf.items():
        args += ["--conf", f"{k}={v}"]
    args.append("spark-internal")
    server = _launch("connect", args, root, host, tool="spark-submit")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            with socket.create_connection((host, port), timeout=1):
                return server, f"sc://{host}:{port}"
        except OSError:
            time.sleep(0.3)
    tail = "\n".join(server.text().splitlines()[-30:])
    server.stop()
    raise RuntimeError(f"the Spark Connect server did not start:\n{tail}")
