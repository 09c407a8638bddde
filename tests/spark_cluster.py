"""A Spark standalone cluster on this machine, for tests: one master and two workers,
each its own JVM started through pyspark's own launcher (``bin/spark-class``, which
``exec``s the JVM, so the process id is the JVM's), waited for through their logs and
ports, and stopped by process id. Each worker offers 1 core and a little memory, so
each executor of an application is its own JVM on its own worker with its own Python
workers. A Spark Connect server (``SparkConnectServer`` through ``spark-submit``) is
started the same way where a test needs one.

Addresses: the machine's routable address when it has one (so the runner's
off-loopback path, mutual TLS included, is what runs), else loopback.

Executors run a packed virtualenv when the session is built with one
(``packed_venv``): pyengine installed from its wheel, as a user installs it, with
its Delta extra, packed by ``venv-pack`` and shipped through ``spark.archives``;
each executor unpacks it into its working directory and starts its Python workers
from it, so nothing of the driver's environment (the editable checkout) is on the
executors' path."""

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
PACKED_ENV = "environment"  # where each executor unpacks the packed virtualenv (spark.archives' "#" name)
REPO = Path(__file__).resolve().parents[1]
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
    # Not the test process's PYTHONPATH: executors inherit their worker's environment
    # and put it on their Python workers' path, which would hand them the driver's
    # pyengine whatever the packed virtualenv holds.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
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

    def session_builder(self, app: str, archive: Optional[Path] = None) -> Any:
        """A session on this cluster; with ``archive`` (``packed_venv``), its executors
        run their Python workers from that packed virtualenv."""
        from pyspark.sql import SparkSession

        builder = (
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
        if archive is not None:
            builder = builder.config("spark.archives", f"{archive}#{PACKED_ENV}").config(
                "spark.pyspark.python", f"./{PACKED_ENV}/bin/python"
            )
        return builder

    def session(self, app: str, archive: Optional[Path] = None) -> Any:
        """``session_builder(app, archive).getOrCreate()``. A driver that is a plain
        Python process (not launched by spark-submit) takes its executors' Python from
        ``PYSPARK_PYTHON`` as its SparkContext starts: ``spark.pyspark.python`` is read
        by spark-submit alone, for a Python application it launches (measured: with the
        setting only, the executors ran the driver's interpreter). So with ``archive``
        the variable names the unpacked environment for that moment."""
        builder = self.session_builder(app, archive)
        if archive is None:
            return builder.getOrCreate()
        before = os.environ.get("PYSPARK_PYTHON")
        os.environ["PYSPARK_PYTHON"] = f"./{PACKED_ENV}/bin/python"
        try:
            return builder.getOrCreate()
        finally:
            if before is None:
                os.environ.pop("PYSPARK_PYTHON", None)
            else:
                os.environ["PYSPARK_PYTHON"] = before

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


def _newest_source() -> float:
    """When the package's sources last changed (what a wheel is built from)."""
    newest = max((REPO / name).stat().st_mtime for name in ("pyproject.toml", "setup.py"))
    for folder in ("pyengine", "bindings", "csrc"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".pyc"):
                newest = max(newest, path.stat().st_mtime)
    return newest


def pyengine_wheel(root: Path) -> Path:
    """pyengine as a wheel: the one CI's packaging step built from this tree
    (``build/dist``) when no source changed since, else one built now (a minute or
    more: the native core compiles). A stale wheel has the same version number, so
    the runner's version check would let its older code run on the executors."""
    built = sorted((REPO / "build" / "dist").glob("pyengine-*.whl"), key=lambda p: p.stat().st_mtime)
    if built and built[-1].stat().st_mtime >= _newest_source():
        return built[-1]
    out = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(REPO)],
        check=True,
        timeout=1200,
    )
    return next(out.glob("pyengine-*.whl"))


def packed_venv(root: Path) -> Path:
    """What a user ships to a cluster whose nodes lack pyengine: a virtualenv with
    ``pyengine[delta]`` installed from its wheel, packed by ``venv-pack`` into a
    ``.tar.gz`` for ``spark.archives``. The interpreter itself is not packed (a
    virtualenv links to its base Python), so every node needs that Python at the
    same path: true of these workers, which share this machine."""
    try:
        import venv_pack
    except ImportError:
        raise RuntimeError(
            "the cluster tests ship pyengine to executors as a venv-pack archive: install the test extra "
            "(pip install -e '.[test]', which brings venv-pack)"
        ) from None
    env = root / "venv"
    python = str(env / "bin" / "python")
    # Nothing of this process's path: a pyengine on PYTHONPATH (a source tree) would
    # look installed to pip, which would then leave it out of the virtualenv.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # What costs time here is CI's: no pip of its own in the virtualenv (this one's
    # installs into it), no bytecode compiled ahead (each executor compiles what it
    # imports), and the fastest gzip level (the archive only crosses this machine).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120, env=clean)
    wheel = pyengine_wheel(root)
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile"]
    subprocess.run([*pip, "--disable-pip-version-check", f"{wheel}[delta]"], check=True, timeout=600, env=clean)
    found = subprocess.run(
        [python, "-c", "import pyengine, sys; print(pyengine.__file__.startswith(sys.prefix))"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean,
        cwd=str(root),
    )
    if found.stdout.strip() != "True":
        raise RuntimeError(f"the virtualenv to pack has no pyengine of its own: {found.stdout}{found.stderr}")
    archive = root / "venv.tar.gz"
    venv_pack.pack(prefix=str(env), output=str(archive), compress_level=1)
    return archive
