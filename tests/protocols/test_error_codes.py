"""protocols/error-codes.md mirrors peerd.errors.ErrorCode exactly (codes, names, one row each)."""

from __future__ import annotations

import re
from pathlib import Path

from peerd.errors import ErrorCode

DOC = Path(__file__).resolve().parents[2] / "protocols" / "error-codes.md"
ROW = re.compile(r"^\| (\d{3}) \| `([A-Z_]+)` \| ([^|]+) \|", re.MULTILINE)


def test_every_code_is_documented_once_with_its_number():
    rows = ROW.findall(DOC.read_text())
    documented = [(int(code), name) for code, name, _ in rows]
    assert len(documented) == len(set(documented))
    assert sorted(documented) == sorted((int(c), c.name) for c in ErrorCode)
    assert all(meaning.strip() for _, _, meaning in rows)


def test_codes_sit_in_their_family():
    rows = ROW.findall(DOC.read_text())
    families = re.findall(r"^\| \*\*(\d)xx\*\* \|", DOC.read_text(), re.MULTILINE)
    assert {int(code) // 100 for code, _, _ in rows} == {int(f) for f in families}
