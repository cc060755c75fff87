"""Reading a swarm secret file (no hivemind here: the config checks it without loading the DHT stack)."""

from __future__ import annotations

from pathlib import Path

from peerd.errors import ConfigError

SECRET_MIN_BYTES = 16  # 128 bits: a shorter secret could be guessed offline from one record's MAC


def load_swarm_secret(path: str | Path) -> bytes:
    """The secret in ``path`` (surrounding whitespace removed); ConfigError naming the field if unusable."""
    path = Path(path).expanduser()
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError("swarm_secret_file", f"cannot read {path}: {exc.strerror or exc}") from None
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(
            "swarm_secret_file",
            f"{path} holds {len(secret)} bytes; a swarm secret needs at least {SECRET_MIN_BYTES} "
            "(e.g. `head -c 32 /dev/urandom | base64 > swarm.secret`)",
        )
    return secret
