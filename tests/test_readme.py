"""README.md and docs/*.md as written: every `bertembed.<name>` they write resolves after a plain `import bertembed`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import bertembed

ROOT = Path(__file__).resolve().parents[1]


DOCUMENTED = sorted(set(re.findall(r"(?<![\w./])bertembed(?:\.\w+)+", " ".join(
    p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]))))


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_every_documented_name_resolves_after_a_plain_import(dotted, monkeypatch):
    """`bertembed.parallel.shard_vocab` and the like, as the docs write them: the package's attribute, not only after
    `import bertembed.parallel` (a submodule imported by an earlier test is taken off the package first)."""
    first, *rest = dotted.split(".")[1:]
    if f"bertembed.{first}" in sys.modules:
        monkeypatch.delattr(bertembed, first, raising=False)
    obj = getattr(bertembed, first)
    for part in rest:
        obj = getattr(obj, part)
