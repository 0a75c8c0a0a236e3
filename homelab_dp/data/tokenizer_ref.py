"""A model's tokenizer named by its folder, loaded only when samples must be tokenized.

The token cache's key needs only the tokenizer's files (`homelab_dp.data.token_cache`), so a
process that finds its samples cached never loads a tokenizer, and never imports transformers
for it: the preflight of a run whose data was tokenized before skips seconds of imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TokenizerRef:
    """The tokenizer of ``folder``; ``load()`` makes it, the first time it is needed."""

    folder: Path
    load: Callable[[], Any]
    _loaded: Any = field(default=None, repr=False)

    def get(self) -> Any:
        """The tokenizer, loaded once."""
        if self._loaded is None:
            self._loaded = self.load()
        return self._loaded


def tokenizer_folder(tokenizer: Any) -> Path | None:
    """The folder a tokenizer (or a `TokenizerRef`) was loaded from, when it is one."""
    if isinstance(tokenizer, TokenizerRef):
        return tokenizer.folder if tokenizer.folder.is_dir() else None
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    return folder if str(folder) and folder.is_dir() else None


def loaded(tokenizer: Any) -> Any:
    """A tokenizer object: a `TokenizerRef` loads its own, anything else is one already."""
    return tokenizer.get() if isinstance(tokenizer, TokenizerRef) else tokenizer
