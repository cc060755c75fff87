"""Local control endpoint: a JSON-lines RPC over a unix socket that the CLI uses to talk to its daemon.

Why a unix socket rather than loopback HTTP: access is governed by file
permissions (the socket is created 0600 inside the 0700 state directory, so
only the daemon's user can drive it), there is no port to choose or collide
on when several daemons run on one machine, nothing is reachable from the
network, and a live socket doubles as a "this home is in use" lock.

Wire format (one JSON object per line, UTF-8, at most ``MAX_MESSAGE`` bytes):
request ``{"v": 1, "method": "status", "params": {...}}``, reply
``{"v": 1, "ok": true, "result": ...}`` or
``{"v": 1, "ok": false, "error": {"code": 100, "name": "MALFORMED", "message": "..."}}``.
Adding a method is one ``server.register("name", handler)`` call; handlers are
``async (params: dict) -> JSON-able`` and read their parameters with ``number_param`` /
``text_param`` (a bad one is a ``ConfigError`` naming it). A handler's error is sent to
the caller, never raised into the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.tasks import within

logger = get_logger(__name__)

VERSION = 1
MAX_MESSAGE = 4 * 1024 * 1024  # a status reply for a few hundred peers is well below this

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class DaemonNotRunning(PeerUnavailable):
    """No daemon answers on the control socket (missing file, refused, or stale)."""


class ControlError(PeerdError):
    """The daemon answered a control call with an error; ``code`` is the daemon's error code."""


class ControlServer:
    """Serves registered methods on a unix socket until ``close()``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handlers: dict[str, tuple[Handler, str]] = {}
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task] = set()
        self.register("methods", self._list_methods, "List the methods this daemon serves.")
        self.register("ping", self._ping, "Check that the daemon answers.")

    def register(self, method: str, handler: Handler, doc: str = "") -> None:
        """Serve ``method`` with ``handler``; ``doc`` is shown by the ``methods`` call."""
        if method in self._handlers:
            raise ValueError(f"control method {method!r} registered twice")
        self._handlers[method] = (handler, doc)

    async def start(self) -> None:
        """Bind the socket; refuses if another live daemon already serves this path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if _answers(self.path):
                raise ConfigError(
                    "control_socket",
                    f"another peerd daemon is already running with this home ({self.path}); "
                    "stop it or choose another --home",
                )
            self.path.unlink()  # a stale socket left by a crashed daemon
        old_umask = os.umask(0o177)  # the socket file is born 0600: no window where others may connect
        try:
            self._server = await asyncio.start_unix_server(
                self._serve_client, path=str(self.path), limit=MAX_MESSAGE
            )
        finally:
            os.umask(old_umask)
        logger.info("control endpoint listening on %s", self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._clients):
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self._server.wait_closed(), 1.0)
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    return  # client closed the connection
                except asyncio.LimitOverrunError:
                    error = ProtocolError(f"request exceeds {MAX_MESSAGE} bytes", code=ErrorCode.OVERSIZED)
                    writer.write(_encode_reply(error=error))
                    await writer.drain()
                    return  # the stream is out of sync now: drop the connection
                writer.write(await self.dispatch(line))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._clients.discard(task)
            writer.close()

    async def dispatch(self, line: bytes) -> bytes:
        """Decode one request line, run its handler, return the encoded reply line."""
        try:
            method, params = _decode_request(line)
            entry = self._handlers.get(method)
            if entry is None:
                raise ProtocolError(
                    f"unknown method {method!r} (known: {', '.join(sorted(self._handlers))})",
                    code=ErrorCode.UNKNOWN_KIND,
                )
            result = await entry[0](params)
            return _encode_reply(result=result)
        except PeerdError as exc:
            return _encode_reply(error=exc)
        except Exception as exc:
            logger.exception("control call failed")
            return _encode_reply(error=PeerdError(f"{type(exc).__name__}: {exc}", code=ErrorCode.INTERNAL))

    async def _list_methods(self, params: dict[str, Any]) -> dict[str, str]:
        return {name: doc for name, (_, doc) in sorted(self._handlers.items())}

    async def _ping(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"pid": os.getpid()}


def number_param(params: dict[str, Any], key: str, *, default: float, gt: float = 0.0) -> float:
    """The number ``params[key]`` (``default`` if absent); ``ConfigError`` naming ``key`` unless finite and > ``gt``."""
    value = params.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= gt
    ):
        raise ConfigError(key, f"must be a number > {gt:g}, got {value!r}")
    return float(value)


def text_param(params: dict[str, Any], key: str, *, default: str, max_chars: int = 200) -> str:
    """The string ``params[key]`` (``default`` if absent or empty), at most ``max_chars`` characters."""
    value = params.get(key) or default
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ConfigError(key, f"at most {max_chars} characters, got {len(value)}")
    return value


def _decode_request(line: bytes) -> tuple[str, dict[str, Any]]:
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"request is not JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("request must be a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(
            f"control protocol version {msg.get('v')!r} not supported (this daemon speaks {VERSION})",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    method, params = msg.get("method"), msg.get("params", {})
    if not isinstance(method, str):
        raise ProtocolError("request needs a string 'method'")
    if not isinstance(params, dict):
        raise ProtocolError("'params' must be a JSON object")
    return method, params


def _encode_reply(*, result: Any = None, error: PeerdError | None = None) -> bytes:
    if error is not None:
        body = {"code": int(error.code), "name": error.code.name, "message": error.message}
        msg: dict[str, Any] = {"v": VERSION, "ok": False, "error": body}
    else:
        msg = {"v": VERSION, "ok": True, "result": result}
    try:
        data = json.dumps(msg, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        err = PeerdError(f"reply is not JSON-serializable: {exc}", code=ErrorCode.INTERNAL)
        return _encode_reply(error=err)
    return data + b"\n"


def _answers(path: Path) -> bool:
    """True if something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


class ControlClient:
    """Blocking client for the CLI: one connection per call, with a deadline."""

    def __init__(self, path: str | Path, timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.timeout = timeout

    def call(self, method: str, **params: Any) -> Any:
        """Run ``method`` on the daemon and return its result; raises ControlError / DaemonNotRunning."""
        request = json.dumps({"v": VERSION, "method": method, "params": params}).encode() + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise DaemonNotRunning(
                    f"no peerd daemon is running at {self.path} ({exc.strerror})"
                ) from None
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                    raise DaemonNotRunning(
                        f"no peerd daemon is running at {self.path} ({exc.strerror})"
                    ) from None
                raise PeerUnavailable(f"cannot reach the daemon at {self.path}: {exc}") from None
            try:
                sock.sendall(request)
                reply = _read_line(sock)
            except TimeoutError:
                raise PeerUnavailable(
                    f"the daemon at {self.path} did not answer {method!r} within {self.timeout:.0f} s",
                    code=ErrorCode.TIMEOUT,
                ) from None
            except OSError as exc:
                raise PeerUnavailable(f"lost the connection to the daemon at {self.path}: {exc}") from None
        return _decode_reply(reply)

    def available(self) -> bool:
        """True if a daemon answers ``ping`` on this socket."""
        try:
            self.call("ping")
        except PeerUnavailable:
            return False
        return True


def _read_line(sock: socket.socket) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise PeerUnavailable("the daemon closed the connection before replying")
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)
        if size > MAX_MESSAGE:
            raise ProtocolError(f"reply exceeds {MAX_MESSAGE} bytes", code=ErrorCode.OVERSIZED)


def _decode_reply(line: bytes) -> Any:
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"daemon reply is not JSON: {exc}") from None
    if not isinstance(msg, dict) or "ok" not in msg:
        raise ProtocolError("daemon reply lacks 'ok'")
    if msg["ok"]:
        return msg.get("result")
    err = msg.get("error") or {}
    if not isinstance(err, dict):
        raise ProtocolError(f"daemon reply's 'error' is a {type(err).__name__}, not a map")
    raw_code = err.get("code")
    try:
        code = ErrorCode(raw_code) if isinstance(raw_code, int) else ErrorCode.INTERNAL
    except ValueError:
        code = ErrorCode.INTERNAL
    raise ControlError(str(err.get("message", "unknown error")), code=code)
