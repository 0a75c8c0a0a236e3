"""Where homelab-dp keeps a user's files, computed once: the XDG folders and their defaults.

* data (``$XDG_DATA_HOME/homelab-dp``, ``~/.local/share/homelab-dp`` by default): the runs folder
  (unless ``$HOMELAB_DP_RUNS`` names another), the run index, both calibrations, the preset
  results, the model-spec census cache, the notifier's config.toml;
* config (``$XDG_CONFIG_HOME/homelab-dp``, ``~/.config/homelab-dp``): saved presets;
* cache (``$XDG_CACHE_HOME/homelab-dp``, ``~/.cache/homelab-dp``): token caches, precomputed
  references, the gloo link measurement; the Hugging Face hub cache sits beside it under the
  same ``$XDG_CACHE_HOME`` (`xdg_cache`).

Every variable is read when asked (never at import), so a test or a child process that sets it
gets its own folders; an empty variable counts as unset, ``~`` is expanded and the answer is
absolute. A folder made for these files is private (`ensure_private_dir`: 0700, what the XDG
specification asks of a folder it creates). Pure standard library.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_FOLDER = "homelab-dp"
"""The folder of homelab-dp under each XDG base folder."""


def _base(variable: str, *default: str) -> Path:
    value = os.environ.get(variable) or str(Path.home().joinpath(*default))
    return Path(value).expanduser().absolute()


def xdg_cache() -> Path:
    """``$XDG_CACHE_HOME`` (``~/.cache`` when unset): the base of every user cache."""
    return _base("XDG_CACHE_HOME", ".cache")


def data_home() -> Path:
    """The per-user data folder: ``$XDG_DATA_HOME/homelab-dp`` (``~/.local/share/homelab-dp``)."""
    return _base("XDG_DATA_HOME", ".local", "share") / APP_FOLDER


def config_home() -> Path:
    """The per-user config folder: ``$XDG_CONFIG_HOME/homelab-dp`` (``~/.config/homelab-dp``)."""
    return _base("XDG_CONFIG_HOME", ".config") / APP_FOLDER


def cache_home() -> Path:
    """The per-user cache folder: ``$XDG_CACHE_HOME/homelab-dp`` (``~/.cache/homelab-dp``)."""
    return xdg_cache() / APP_FOLDER


def ensure_private_dir(path: Path | str) -> Path:
    """Create ``path`` and any missing parents private to the user (0700), returning it
    absolute; folders that exist are left as they are. OSError if it cannot (a file in the way)."""
    path = Path(path).expanduser().absolute()
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            if not folder.is_dir():  # a file in the way
                raise
            continue  # made by a concurrent process a moment ago
        os.chmod(folder, 0o700)  # mkdir's mode is masked by the umask
    return path
