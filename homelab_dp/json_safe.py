"""JSON that is always JSON: non-finite floats become null, never ``NaN`` or ``Infinity``.

Python's `json` writes ``NaN``/``Infinity`` by default, which no strict JSON reader accepts
(``jq``, JavaScript, most languages). Every JSON writer of homelab-dp goes through `dumps` or
`dump`: the document is first copied with each non-finite float replaced by None (`finite_doc`)
and then written with ``allow_nan=False``, so a NaN that slipped past is an error here, never
a broken file. Pure standard library (core/).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import IO, Any


def finite(value: float | None) -> float | None:
    """``value``, or None when it is NaN or ±infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finite_doc(doc: Any) -> Any:
    """A copy of a JSON-ready document with every non-finite float (at any depth) as None.

    Tuples become lists (as `json` writes them); other values are returned as they are."""
    if isinstance(doc, float):
        return finite(doc)
    if isinstance(doc, dict):
        return {k: finite_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [finite_doc(v) for v in doc]
    return doc


def _finite_default(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with its ``default`` (what turns an unknown object, a tensor say, into JSON)
    made finite too: what it returns goes through `finite_doc`."""
    default: Callable[[Any], Any] | None = kwargs.get("default")
    if default is not None:
        kwargs = {**kwargs, "default": lambda obj: finite_doc(default(obj))}
    return kwargs


def dumps(doc: Any, **kwargs: Any) -> str:
    """`json.dumps` of `finite_doc` (``doc``) with ``allow_nan=False``; ``kwargs`` as for it."""
    return json.dumps(finite_doc(doc), allow_nan=False, **_finite_default(kwargs))


def dump(doc: Any, fh: IO[str], **kwargs: Any) -> None:
    """`json.dump` of `finite_doc` (``doc``) to ``fh`` with ``allow_nan=False``."""
    json.dump(finite_doc(doc), fh, allow_nan=False, **_finite_default(kwargs))
