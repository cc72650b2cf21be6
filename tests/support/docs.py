"""The docs' Python samples, as the tests run them."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"```python\n(.*?)^ *```", re.S | re.M)


def samples(page: str) -> list[str]:
    found = [textwrap.dedent(block) for block in FENCE.findall((DOCS / page).read_text())]
    assert found, f"no python samples in {page}"
    return found
