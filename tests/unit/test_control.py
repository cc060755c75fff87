"""The control endpoint over a real unix socket: calls, typed errors, bad input, stale sockets, permissions."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import threading
from pathlib import Path

import pytest

import peerd.control as control
from peerd.control import ControlClient, ControlError, ControlServer, DaemonNotRunning
from peerd.errors import ConfigError, ErrorCode, PeerUnavailable, ProtocolError


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "ctl.sock"


def _serve(path: Path, body, *, setup=None) -> None:
    """Start a server on ``path`` with ``echo``, ``boom``, ``bad_input`` and ``hang`` methods, run ``body`` (blocking client code) in a thread."""

    async def main() -> None:
        server = ControlServer(path)

        async def echo(params: dict) -> dict:
            return {"echo": params}

        async def boom(params: dict) -> None:
            raise RuntimeError("a bug in a handler")

        async def bad_input(params: dict) -> None:
            raise ConfigError("params.n", "must be positive")

        async def hang(params: dict) -> str:
            await asyncio.Event().wait()  # never answers; the server's close cancels it
            return "never"

        server.register("echo", echo, "Return the params.")
        server.register("boom", boom)
        server.register("bad_input", bad_input)
        server.register("hang", hang)
        if setup is not None:
            setup(server)
        await server.start()
        try:
            await asyncio.to_thread(body)
        finally:
            await server.close()

    asyncio.run(main())


def _raw(path: Path, data: bytes) -> list[dict]:
    """Send raw bytes on one connection and read every reply line until the server closes or goes quiet."""
    replies = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        for line in sock.makefile("rb"):
            replies.append(json.loads(line))
    return replies


def test_calls_and_introspection(sock_path):
    def body():
        client = ControlClient(sock_path, timeout=5)
        assert client.call("echo", a=1, b=[1, 2]) == {"echo": {"a": 1, "b": [1, 2]}}
        methods = client.call("methods")
        assert methods["echo"] == "Return the params."
        assert {"methods", "ping", "echo", "boom"} <= set(methods)
        assert isinstance(client.call("ping")["pid"], int)
        assert client.available()

    _serve(sock_path, body)
    assert not sock_path.exists()  # close() removes the socket file


def test_handler_errors_come_back_typed_and_the_server_keeps_serving(sock_path):
    def body():
        client = ControlClient(sock_path, timeout=5)
        with pytest.raises(ControlError) as info:
            client.call("nope")
        assert info.value.code == ErrorCode.UNKNOWN_KIND and "echo" in str(info.value)
        with pytest.raises(ControlError) as info:
            client.call("boom")
        assert info.value.code == ErrorCode.INTERNAL and "a bug in a handler" in str(info.value)
        with pytest.raises(ControlError) as info:
            client.call("bad_input")
        assert info.value.code == ErrorCode.CONFIG_INVALID and "params.n" in str(info.value)
        assert client.call("echo", still="alive") == {"echo": {"still": "alive"}}

    _serve(sock_path, body)


def test_malformed_requests_get_error_replies_on_the_same_connection(sock_path):
    def body():
        lines = [
            b"\xff\xfe garbage\n",
            b"[1, 2, 3]\n",
            b'{"v": 99, "method": "echo"}\n',
            b'{"v": 1}\n',
            b'{"v": 1, "method": "echo", "params": [1]}\n',
            b'{"v": 1, "method": "echo", "params": {"x": 1}}\n',
        ]
        replies = _raw(sock_path, b"".join(lines))
        codes = [r["error"]["name"] if not r["ok"] else "OK" for r in replies]
        assert codes == ["MALFORMED", "MALFORMED", "UNSUPPORTED_VERSION", "MALFORMED", "MALFORMED", "OK"]
        assert replies[-1]["result"] == {"echo": {"x": 1}}
        assert ControlClient(sock_path).call("ping")

    _serve(sock_path, body)


def test_oversized_request_is_refused_and_the_server_survives(sock_path, monkeypatch):
    monkeypatch.setattr(control, "MAX_MESSAGE", 1024)

    def body():
        replies = _raw(sock_path, b'{"v": 1, "method": "echo", "params": {"x": "' + b"a" * 5000 + b'"}}\n')
        assert replies[0]["error"]["name"] == "OVERSIZED"
        assert ControlClient(sock_path).call("echo", small=True) == {"echo": {"small": True}}

    _serve(sock_path, body)


def test_unserializable_result_is_an_internal_error(sock_path):
    def setup(server):
        async def weird(params):
            return {"not json": object()}

        server.register("weird", weird)

    def body():
        with pytest.raises(ControlError) as info:
            ControlClient(sock_path).call("weird")
        assert info.value.code == ErrorCode.INTERNAL

    _serve(sock_path, body, setup=setup)


def test_client_timeout_is_a_typed_error(sock_path):
    def body():
        with pytest.raises(PeerUnavailable) as info:
            ControlClient(sock_path, timeout=0.3).call("hang")
        assert info.value.code == ErrorCode.TIMEOUT

    _serve(sock_path, body)


def test_socket_is_private(sock_path):
    def body():
        mode = stat.S_IMODE(sock_path.stat().st_mode)
        assert mode & 0o077 == 0, oct(mode)

    _serve(sock_path, body)


def test_no_daemon_and_stale_socket(sock_path):
    with pytest.raises(DaemonNotRunning):
        ControlClient(sock_path).call("ping")
    # a socket file left behind by a crashed daemon: nobody accepts on it
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
    assert sock_path.exists()
    with pytest.raises(DaemonNotRunning):
        ControlClient(sock_path).call("ping")
    assert not ControlClient(sock_path).available()

    def body():  # a new server replaces the stale file
        assert ControlClient(sock_path).call("echo") == {"echo": {}}

    _serve(sock_path, body)


def test_second_server_on_a_live_socket_is_refused(sock_path):
    def body():
        async def second() -> None:
            await ControlServer(sock_path).start()

        with pytest.raises(ConfigError) as info:
            asyncio.run(second())
        assert "already running" in str(info.value)
        assert ControlClient(sock_path).call("ping")  # the first one is untouched

    _serve(sock_path, body)


def test_register_twice_is_a_bug():
    server = ControlServer("/nonexistent/ctl.sock")

    async def handler(params):
        return None

    server.register("x", handler)
    with pytest.raises(ValueError):
        server.register("x", handler)


def test_malformed_error_replies_from_a_daemon_are_typed_errors(sock_path):
    """A daemon speaking a broken dialect: the client raises typed errors, not AttributeError."""
    replies = [
        b'{"ok": false, "error": "boom"}\n',
        b'{"ok": false, "error": {"code": "400", "message": "string code"}}\n',
        b'{"ok": false, "error": {"code": 12345, "message": "unknown code"}}\n',
        b'{"ok": false, "error": {"code": 400, "message": "known code"}}\n',
    ]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen()
    srv.settimeout(10)

    def serve() -> None:
        with srv:
            for reply in replies:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ControlClient(sock_path, timeout=5)
    with pytest.raises(ProtocolError, match="not a map"):
        client.call("status")
    for message, code in (
        ("string code", ErrorCode.INTERNAL),
        ("unknown code", ErrorCode.INTERNAL),
        ("known code", ErrorCode.CONFIG_INVALID),
    ):
        with pytest.raises(ControlError, match=message) as info:
            client.call("status")
        assert info.value.code == code
    thread.join(5)
    assert not thread.is_alive()


def test_parameter_readers_name_the_bad_parameter_over_the_socket(sock_path):
    """``number_param``/``text_param`` in a real handler: good values pass, bad ones come back as CONFIG_INVALID."""

    def setup(server: ControlServer) -> None:
        async def leave(params: dict) -> dict:
            grace = control.number_param(params, "grace_s", default=60.0)
            return {
                "grace_s": grace,
                "reason": control.text_param(params, "reason", default="none", max_chars=8),
            }

        server.register("leave", leave)

    def body() -> None:
        client = ControlClient(sock_path)
        assert client.call("leave") == {"grace_s": 60.0, "reason": "none"}
        assert client.call("leave", grace_s=5, reason="gpu") == {"grace_s": 5.0, "reason": "gpu"}
        assert client.call("leave", reason="") == {"grace_s": 60.0, "reason": "none"}
        for params, words in (
            ({"grace_s": 0}, "grace_s: must be a number > 0, got 0"),
            ({"grace_s": -3.5}, "grace_s: must be a number > 0"),
            ({"grace_s": True}, "grace_s: must be a number > 0, got True"),
            ({"grace_s": "soon"}, "grace_s: must be a number > 0, got 'soon'"),
            ({"reason": 7}, "reason: must be a string, got int"),
            ({"reason": "far too long"}, "reason: at most 8 characters, got 12"),
        ):
            with pytest.raises(ControlError) as info:
                client.call("leave", **params)
            assert info.value.code == ErrorCode.CONFIG_INVALID
            assert words in str(info.value), (params, str(info.value))

    _serve(sock_path, body, setup=setup)
