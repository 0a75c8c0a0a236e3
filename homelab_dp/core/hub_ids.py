"""Is a `model.path` / `data.path` / MODEL value a Hugging Face Hub id rather than a path?

Pure: the rule only. A local path wins whenever it exists; a value that exists nowhere and
reads as ``org/name`` (Hub naming: letters, digits, ``-``, ``_``, ``.``; no leading ``.``, no
``..``) is taken as an id.
"""

from __future__ import annotations

import re

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_ID = re.compile(rf"^{_PART}/{_PART}$")


def looks_like_hub_id(value: str) -> bool:
    """True when ``value`` has the shape of a Hub repository id (``Qwen/Qwen2.5-0.5B``)."""
    return (
        bool(_HUB_ID.match(value))
        and ".." not in value
        and not value.endswith((".json", ".jsonl", ".csv", ".parquet", ".txt", ".toml"))
    )
