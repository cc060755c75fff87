"""Typed field readers for decoding peerd's DHT records: every failure is MALFORMED and names the dotted field."""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

from peerd.errors import ProtocolError

BASE58_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")
JOB_ID_RE = re.compile(r"^[0-9a-f]{32}$")


class Fields:
    """Typed reads of one decoded map; errors are MALFORMED and name the dotted field."""

    def __init__(self, m: Any, what: str, where: str = "") -> None:
        if not isinstance(m, dict) or not all(isinstance(k, str) for k in m):
            raise ProtocolError(f"{what}: {where or 'top level'}: expected a map with string keys")
        self.m, self.what, self.where = m, what, where

    def bad(self, key: str, why: str) -> ProtocolError:
        return ProtocolError(f"{self.what}: {self.where}{key}: {why}")

    def get(self, key: str, optional: bool = False) -> Any:
        value = self.m.get(key)
        if value is None and not optional:
            raise self.bad(key, "missing")
        return value

    def text(self, key: str, max_chars: int = 128, optional: bool = False) -> str:
        value = self.get(key, optional)
        if value is None:
            return ""
        if not isinstance(value, str) or len(value) > max_chars:
            raise self.bad(key, f"expected a string of at most {max_chars} characters")
        return value

    def count(self, key: str) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise self.bad(key, f"expected a non-negative integer, got {value!r}")
        return value

    def opt_real(self, key: str, optional: bool = False, positive: bool = False) -> float | None:
        value = self.get(key, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.bad(key, f"expected a number, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise self.bad(key, f"expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        return value

    def real(self, key: str, positive: bool = False) -> float:
        value = self.opt_real(key, positive=positive)
        assert value is not None
        return value

    def peer(self, key: str) -> str:
        value = self.text(key)
        if not BASE58_RE.fullmatch(value):
            raise self.bad(key, f"{value!r} is not a base58 libp2p peer id")
        return value

    def job_id(self, key: str = "job_id") -> str:
        value = self.text(key)
        if not JOB_ID_RE.fullmatch(value):
            raise self.bad(key, f"{value!r} is not a job id (32 lowercase hex digits)")
        return value

    def enum(self, cls: type[StrEnum], key: str) -> Any:
        value = self.text(key, max_chars=32)
        try:
            return cls(value)
        except ValueError:
            raise self.bad(key, f"unknown value {value!r}") from None

    def sub(self, key: str) -> Fields:
        return Fields(self.get(key), self.what, f"{self.where}{key}.")
