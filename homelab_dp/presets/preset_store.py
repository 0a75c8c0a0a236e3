"""Finding presets by name, resolving their relative paths, and saving new ones.

Presets are looked up, in order, in ``$HOMELAB_DP_PRESETS``, the user's presets folder
(``$XDG_CONFIG_HOME/homelab-dp/presets``, where `presets save` writes), ``./presets`` and the
presets shipped with the project.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from homelab_dp.errors import PresetError
from homelab_dp.hub.hub_models import looks_like_hub_id
from homelab_dp.presets.preset import Preset, apply_overrides, load_preset
from homelab_dp.user_files.paths import config_home
from homelab_dp.user_files.private_write import write_whole

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PRESETS = PROJECT_ROOT / "presets"


def user_presets_dir() -> Path:
    """Where `presets save` writes: $XDG_CONFIG_HOME/homelab-dp/presets."""
    return config_home() / "presets"


def search_dirs() -> list[Path]:
    """Folders searched for a preset given by name, first match wins."""
    dirs = []
    if os.environ.get("HOMELAB_DP_PRESETS"):
        dirs.append(Path(os.environ["HOMELAB_DP_PRESETS"]))
    dirs += [user_presets_dir(), Path.cwd() / "presets", SHIPPED_PRESETS]
    seen: list[Path] = []
    for d in dirs:
        if d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


def find_preset(name_or_path: str) -> Path:
    """A preset file from a path or a name (with or without .toml)."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file():
        return path
    if path.suffix == ".toml" and (path.parent != Path(".") or path.exists()):
        raise PresetError(
            f"{name_or_path}: no such preset file",
            hint="`homelab-dp presets list` shows the known presets",
        )
    stem = path.name[:-5] if path.name.endswith(".toml") else path.name
    for folder in search_dirs():
        candidate = folder / f"{stem}.toml"
        if candidate.is_file():
            return candidate
    raise PresetError(
        f"preset {name_or_path!r}: not a file and not a known preset name",
        hint="`homelab-dp presets list` shows the known presets; or give a path to a .toml file",
    )


def list_presets() -> list[tuple[str, Path]]:
    """(name, path) of every preset found, first occurrence of a name wins."""
    found: dict[str, Path] = {}
    for folder in search_dirs():
        if folder.is_dir():
            for path in sorted(folder.glob("*.toml")):
                found.setdefault(path.stem, path)
    return sorted(found.items())


def header_comment(path: Path) -> str:
    """The comment lines at the top of a preset file (its command and target hardware)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return "\n".join(lines).strip()


def is_bare_name(value: str) -> bool:
    """Whether ``value`` is one plain name (no folder separator, no ``~``, not ``.``/``..``):
    as model.path, a run id or unique id prefix when no file or folder has that name."""
    return (
        bool(value.strip())
        and "/" not in value
        and os.sep not in value
        and (value not in (".", "..") and not value.startswith("~"))
    )


def _resolve_path(value: str, preset_file: Path | None, *, run_name: bool = False) -> str:
    """``value`` made absolute: from the current folder, beside the preset file, one folder
    above it. Found nowhere: a Hugging Face id is kept as typed, and so is a bare name when
    ``run_name`` (model.path: a run id or prefix, which `runs.model_ref` resolves from the run
    index wherever the command is run)."""
    p = Path(os.path.expanduser(value))  # ~nobody: kept as typed
    if p.is_absolute():
        return str(p)
    bases = [Path.cwd()]
    if preset_file is not None:
        folder = preset_file.resolve().parent
        bases += [folder, folder.parent]
    for base in bases:
        if _exists(base / p):
            return str((base / p).resolve())
    if looks_like_hub_id(value):  # found nowhere on disk: a Hugging Face id, kept as typed
        return value
    if run_name and is_bare_name(value):  # a run id or prefix, looked up in the run index
        return value
    return str((Path.cwd() / p).absolute())


def _exists(path: Path) -> bool:
    """Whether anything is at ``path``; a name the system refuses (too long) is nothing there."""
    try:
        return path.exists()
    except OSError:
        return False


def with_resolved_paths(preset: Preset) -> Preset:
    """A copy whose model and data paths are absolute (see ModelSection.path for the order)."""
    source = Path(preset.source) if preset.source else None
    model = replace(preset.model, path=_resolve_path(preset.model.path, source, run_name=True))
    data = replace(preset.data, path=_resolve_path(preset.data.path, source))
    if data.eval_path:  # "" stays "": no eval file
        data = replace(data, eval_path=_resolve_path(data.eval_path, source))
    if isinstance(data.sample_prompts, str) and data.sample_prompts:  # a file of prompts
        data = replace(data, sample_prompts=_resolve_path(data.sample_prompts, source))
    # A bench task file (a .yaml name or a path; not a task name): the run's keeper runs the
    # benchmarks from the run folder, so a relative path is made absolute here.
    tasks = [_resolve_path(t, source) if t.lower().endswith((".yaml", ".yml")) or "/" in t
             else t for t in preset.train.bench_tasks]  # fmt: skip
    train = replace(preset.train, bench_tasks=tasks)
    return replace(preset, model=model, data=data, train=train)


def open_preset(name_or_path: str, overrides: list[str] | None = None) -> Preset:
    """Find, read, validate and override a preset; paths made absolute."""
    preset = load_preset(find_preset(name_or_path))
    preset = apply_overrides(preset, overrides or [])
    return with_resolved_paths(preset)


def preset_toml(preset: Preset, header: str) -> str:
    """A preset as TOML text with a header comment. ``tomli_w`` (a declared dependency) is
    imported here, where a preset is written, so that everything else (plan, run, measure,
    eval, serve) works on a machine without it (benchmarks/gpu_validate.py on a bare card)."""
    try:
        import tomli_w  # pure-Python TOML writer
    except ImportError as exc:
        raise PresetError(
            "writing a preset needs the tomli-w package, which is not installed",
            hint="pip install tomli-w (a dependency of homelab-dp)",
        ) from exc
    comment = "\n".join(f"# {line}".rstrip() for line in header.splitlines())
    return f"{comment}\n{tomli_w.dumps(preset.to_dict())}"


def save_preset(name: str, preset: Preset, *, force: bool = False) -> Path:
    """Write ``preset`` as ``name`` in the user's presets folder; never overwrite unless forced."""
    if not name or "/" in name or name.startswith(".") or name.endswith(".toml"):
        raise PresetError(
            f"presets save: bad name {name!r}",
            hint="a plain name like my-qlora (no slashes, no .toml)",
        )
    folder = user_presets_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    if path.exists() and not force:
        raise PresetError(
            f"presets save: {path} already exists", hint="choose another name or pass --force"
        )
    header = f"homelab-dp run {name}\n\nSaved from {preset.source or 'the TUI'}."
    return write_whole(path, preset_toml(preset, header))
