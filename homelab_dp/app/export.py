"""`homelab-dp export RUN --format F --out DIR`: a run's result as a folder other tools load.

Formats:

- ``hf``: a standalone Hugging Face model folder. A full fine-tune: its ``final/`` copied as
  it is; an adapter run: its merged model (``final/merged/`` copied where the run merged it
  with ``train.merge``, else merged now as for ``merged``).
- ``adapter``: the PEFT adapter folder (``final/`` without ``merged/``); a full fine-tune has
  none (exit 2).
- ``merged``: the adapter merged into its base in the run's compute dtype (bf16 for a CUDA run,
  fp32 for a CPU run: the run spec's ``resolved.dtype``), safetensors only, the tokenizer with
  its chat template, config.json naming the dtype; a full fine-tune is cast to that dtype.
- ``ollama``: ``merged`` plus a ``Modelfile`` (`serving.replica.prompt_templates`): ``ollama create NAME -f
  DIR/Modelfile`` imports it.
- ``gguf``: ``merged`` converted by llama.cpp's ``convert_hf_to_gguf.py`` (``$LLAMA_CPP_DIR``,
  else on PATH) with this Python, into ``model.gguf`` (in the compute dtype: bf16, f16 or f32)
  beside a Modelfile ``FROM ./model.gguf``. The ``gguf`` package alone cannot do it: it reads
  and writes GGUF files but has no Hugging Face converter.

DIR must not exist or be empty; nothing is ever overwritten. DIR is checked as its real path
(every link resolved): inside the run or its model folders, under /proc, /sys or /dev, a link
itself, or where this user cannot write, it is refused (exit 2) before anything is written. The export is written into a
hidden folder beside DIR and renamed to DIR at the end, so a failed export leaves nothing
half-written. Everything is checked before anything is written (no result yet, an adapter
export of a full fine-tune, a gguf export without the converter, a DIR that holds files).

The torch part (`serving.replica.result_model`) is imported only when a format needs it: the TUI imports this
module for nothing but `export_in_child`, which runs the export as ``python -m
homelab_dp.app.export`` (one JSON line back), so the TUI's process never loads torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.errors import HomelabError
from homelab_dp.probe.visible_gpus import cuda_device_env
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.model_ref import ModelRef, resolve_model

FORMATS = ("hf", "adapter", "merged", "ollama", "gguf")
CONVERTER = "convert_hf_to_gguf.py"
LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
GGUF_TYPES = {"bf16": "bf16", "fp16": "f16", "fp32": "f32", "auto": "auto"}
GGUF_HINT = (
    "git clone https://github.com/ggml-org/llama.cpp and set LLAMA_CPP_DIR to it (its "
    "converter also needs `pip install -r $LLAMA_CPP_DIR/requirements/"
    "requirements-convert_hf_to_gguf.txt`), or put convert_hf_to_gguf.py on PATH and pip "
    'install "homelab-dp[gguf]" for the gguf package it imports. The gguf package alone has no '
    "Hugging Face converter; `--format ollama` needs none (ollama create imports safetensors)"
)


class ExportFailed(HomelabError):
    """The export itself failed (the converter exited with an error): exit 1, not bad input."""

    exit_code = 1


@dataclass(frozen=True)
class Source:
    """What a run's result holds, for exporting."""

    ref: ModelRef
    """The MODEL the run names (its template, data format, trust_remote_code)."""
    weights: Path
    """A full model folder: the fine-tuned model, or the base an adapter applies to."""
    adapter: Path | None
    """The PEFT adapter folder; None for a full fine-tune."""
    merged: Path | None
    """The run's own merge (``final/merged/``, `train.merge`), if any."""
    dtype: str
    """The compute dtype to export in (fp32 | bf16 | fp16; ``auto`` for a bare folder)."""

    @property
    def tokenizer(self) -> Path:
        """The tokenizer saved with the result (the base's where it has none)."""
        for folder in (self.adapter, self.ref.path, self.weights):
            if folder is not None and (folder / "tokenizer_config.json").is_file():
                return folder
        return self.weights


@dataclass
class ExportResult:
    """What an export wrote."""

    format: str
    out: Path
    files: list[str]
    """Every file written, relative to ``out``, sorted."""
    bytes: int
    dtype: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document."""
        return {"format": self.format, "out": str(self.out), "files": self.files,
                "bytes": self.bytes, "dtype": self.dtype, "notes": self.notes}  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ExportResult:
        """Read back `to_json` (the export child's answer)."""
        return cls(doc["format"], Path(doc["out"]), list(doc["files"]), int(doc["bytes"]),
                   str(doc.get("dtype", "")), list(doc.get("notes", [])))  # fmt: skip


def _adapter_base(adapter: Path, preset_path: str | None) -> Path:
    """The base of a run's adapter: the run's model folder, else the one the adapter names."""
    try:
        named = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
        named = named.get("base_model_name_or_path")
    except (OSError, ValueError):
        named = None
    for candidate in (preset_path, named):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Path(candidate).absolute()
    raise HomelabError(
        f"{adapter}: the adapter's base model {named or preset_path!r} is not a local folder",
        hint="put the base model back at that path to merge, or export `--format adapter`",
    )


def find_source(run: str) -> Source:
    """The result RUN names (a run id or prefix, a run folder; a model or adapter folder too)."""
    ref = resolve_model(run)
    if ref.run_dir is None:  # a bare model or adapter folder: keep its stored dtype
        return Source(ref, ref.base or ref.path, ref.path if ref.is_adapter else None, None, "auto")
    spec = read_run_spec(ref.run_dir)
    final = ref.run_dir / "final"
    dtype = str(spec.resolved.dtype)
    if not (final / "adapter_config.json").is_file():
        return Source(ref, final, None, None, dtype)
    merged = final / "merged" if (final / "merged" / "config.json").is_file() else None
    base = ref.base or _adapter_base(final, spec.preset.model.path)
    return Source(ref, base, final, merged, dtype)


def find_converter() -> Path | None:
    """llama.cpp's HF-to-GGUF converter: ``$LLAMA_CPP_DIR/convert_hf_to_gguf.py``, else on PATH."""
    folder = os.environ.get(LLAMA_CPP_ENV)
    if folder:
        script = Path(folder).expanduser() / CONVERTER
        if not script.is_file():
            raise HomelabError(
                f"gguf export: {LLAMA_CPP_ENV}={folder} holds no {CONVERTER}",
                hint=f"point {LLAMA_CPP_ENV} at a llama.cpp checkout (its top folder)",
            )
        return script
    found = shutil.which(CONVERTER)
    return Path(found) if found else None


SPECIAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
"""Kernel file systems: nothing is ever exported there (but /dev/shm, a RAM disk)."""


def check_out(out: Path) -> Path:
    """``out`` as an absolute real path (every link resolved: where the files would really
    land) that does not exist or is an empty folder, in a place a folder can be made (else
    exit 2). A link at ``out`` itself is refused: the rename at the end would replace it."""
    given = out.expanduser().absolute()
    if given.is_symlink():
        raise HomelabError(
            f"--out {given}: a link is there (to {os.readlink(given)}); an export never "
            "writes through or over a link",
            hint="give the real folder's path, or a new folder that is not there",
        )
    try:
        out = given.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop
        raise HomelabError(f"--out {given}: cannot be resolved ({exc})",
                           hint="give a folder path without link loops") from None  # fmt: skip
    for root in SPECIAL_ROOTS:
        if out.is_relative_to(root) and not out.is_relative_to("/dev/shm"):
            raise HomelabError(
                f"--out {given}: under {root}, a kernel file system, not a place for files",
                hint="give a folder on a disk, e.g. ./exports/NAME",
            )
    if out.is_dir():
        try:
            if any(out.iterdir()):
                raise HomelabError(
                    f"--out {out}: the folder is not empty; an export never overwrites",
                    hint="give a new folder (it is created), or empty or remove this one",
                )
        except OSError as exc:
            raise _unwritable(given, exc) from None
    elif out.exists():
        raise HomelabError(f"--out {out}: a file is there", hint="give a folder that is not there")
    writable_parent(given, out)
    return out


def _unwritable(given: Path, exc: OSError) -> HomelabError:
    return HomelabError(
        f"--out {given}: cannot be written ({exc.strerror or exc})",
        hint="give a folder you can write to, e.g. ./exports/NAME",
    )


def writable_parent(given: Path, out: Path) -> None:
    """The nearest existing folder above ``out`` is a folder this user may write in (nothing
    is made here: the export makes its folders only once every check has passed)."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise HomelabError(f"--out {given}: {parent} is a file, not a folder",
                           hint="give a path whose parents are folders")  # fmt: skip
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HomelabError(
            f"--out {given}: {parent} is not writable by this user",
            hint="give a folder you can write to, e.g. ./exports/NAME",
        )


def check_export(run: str, fmt: str, out: Path) -> tuple[Source, Path, Path | None]:
    """Every check before anything is written: the source, the format, the converter, DIR."""
    if fmt not in FORMATS:
        raise HomelabError(f"--format {fmt!r}: not a format", hint=f"one of {', '.join(FORMATS)}")
    source = find_source(run)
    if fmt == "adapter" and source.adapter is None:
        raise HomelabError(
            f"{source.ref.name}: a full fine-tune has no adapter to export",
            hint="export its model with --format hf, merged, ollama or gguf",
        )
    converter = None
    if fmt == "gguf":
        converter = find_converter()
        if converter is None:
            raise HomelabError(
                f"gguf export needs llama.cpp's converter ({CONVERTER}): not found in "
                f"${LLAMA_CPP_ENV} nor on PATH",
                hint=GGUF_HINT,
            )
    out = check_out(out)
    for folder in (source.ref.run_dir, source.weights, source.adapter, source.ref.path):
        if folder is not None and out.is_relative_to(folder.resolve()):  # real paths both
            raise HomelabError(
                f"--out {out}: inside {folder}, which the export reads",
                hint="give a folder outside the run and its model folders",
            )
    return source, out, converter


def _copy(src: Path, dest: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy the folder ``src`` into ``dest``, leaving out ``skip`` at its top."""

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n in skip and Path(folder) == src]

    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=ignore)


def cpu_child_env() -> dict[str, str]:
    """The environment of a child that merges or converts on the CPU: no card visible (the
    launcher's one rule, `probe.visible_gpus.cuda_device_env`, with no card)."""
    return cuda_device_env(os.environ, [])


def _merge(source: Source, dest: Path) -> None:
    from homelab_dp.serving.replica.result_model import (
        merge_to,  # torch: only for the formats that merge
    )

    trust = source.ref.trust_remote_code
    merge_to(source.weights, source.adapter, source.tokenizer, dest, source.dtype, trust)


def _modelfile(source: Source, folder: Path, dest: Path, from_: str) -> list[str]:
    """Write ``dest/Modelfile`` for the model in ``folder``; the notes it comes with."""
    from transformers import AutoTokenizer

    from homelab_dp.serving.replica.prompt_templates import build_modelfile, template_for
    from homelab_dp.serving.replica.result_model import eos_texts

    tokenizer = AutoTokenizer.from_pretrained(
        folder, trust_remote_code=source.ref.trust_remote_code
    )
    modelfile = build_modelfile(
        tokenizer, template_for(tokenizer, source.ref), eos_texts(folder), from_
    )
    (dest / "Modelfile").write_text(modelfile.text, encoding="utf-8")
    return [f"template: {modelfile.template_kind}", *modelfile.notes]


def _gguf(source: Source, converter: Path, staging: Path) -> None:
    merged = staging / ".merged"
    merged.mkdir()
    _merge(source, merged)
    outfile = staging / "model.gguf"
    cmd = [sys.executable, str(converter), str(merged), "--outfile", str(outfile),
           "--outtype", GGUF_TYPES.get(source.dtype, "auto")]  # fmt: skip
    env = cpu_child_env()  # it converts on the CPU: no CUDA context
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0 or not outfile.is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ExportFailed(
            f"gguf export: {converter} exited with {done.returncode}: {tail}",
            hint="see the converter's message; it may not know this architecture yet, or need "
            f"its requirements (pip install -r {converter.parent}/requirements/"
            "requirements-convert_hf_to_gguf.txt)",
        )
    _modelfile(source, merged, staging, "./model.gguf")
    shutil.rmtree(merged)


def _write(source: Source, fmt: str, staging: Path, converter: Path | None) -> list[str]:
    """Write the export into ``staging``; its notes."""
    if fmt == "adapter":
        assert source.adapter is not None
        _copy(source.adapter, staging, skip=("merged",))
        return []
    if fmt == "hf" and source.adapter is None:
        _copy(source.weights, staging)
        return []
    if fmt == "hf" and source.merged is not None:
        _copy(source.merged, staging)
        return ["the run's own merge (final/merged)"]
    if fmt == "gguf":
        assert converter is not None
        _gguf(source, converter, staging)
        return []
    _merge(source, staging)  # hf of an adapter run, merged, ollama
    if fmt == "ollama":
        return _modelfile(source, staging, staging, ".")
    return []


def _listing(out: Path) -> tuple[list[str], int]:
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return files, sum((out / f).stat().st_size for f in files)


def _modes_by_umask(folder: Path) -> None:
    """The modes any tool gives what it writes (0666 and 0777 less the umask), to ``folder``
    and everything in it: mkdtemp made it 0700, and writers in it chose their own modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def export_run(run: str, fmt: str, out: Path) -> ExportResult:
    """Export RUN's result as ``fmt`` into ``out`` (see the module docstring). A user mistake
    raises its HomelabError before anything is written; any failure leaves ``out`` as it was."""
    source, out, converter = check_export(run, fmt, out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".export", dir=out.parent))
    except OSError as exc:  # a read-only file system, a full disk: nothing was written
        raise _unwritable(out, exc) from None
    try:
        try:
            notes = _write(source, fmt, staging, converter)
        except OSError as exc:  # a full disk, a folder that cannot be read: no traceback
            raise ExportFailed(
                f"export to {out} failed: {exc}",
                hint="free space beside DIR, or check the folders' permissions",
            ) from None
        _modes_by_umask(staging)  # mkdtemp's 0700 would keep other users (an ollama server) out
        check_out(out)  # someone may have written there meanwhile
        try:
            staging.rename(out)  # onto an empty folder too: atomic on POSIX
        except OSError as exc:
            raise HomelabError(
                f"--out {out}: cannot be written ({exc.strerror})", hint="give a new folder"
            ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files, size = _listing(out)
    as_saved = fmt == "adapter" or (fmt == "hf" and (source.adapter is None or source.merged))
    dtype = "as saved" if as_saved else source.dtype
    return ExportResult(fmt, out, files, size, dtype, notes)


def export_in_child(run: str, fmt: str, out: Path) -> ExportResult:
    """`export_run` in a child process (`python -m homelab_dp.app.export`), so the caller
    (the TUI) never loads torch; its HomelabError comes back as the same error."""
    cmd = [sys.executable, "-m", "homelab_dp.app.export", run, "--format", fmt, "--out", str(out)]
    env = cpu_child_env()  # merge on the CPU: no CUDA context
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = done.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ExportFailed(f"export failed (exit {done.returncode}): {tail[0]}",
                           hint="run `homelab-dp export` in a shell to see why") from None  # fmt: skip
    if "error" in doc:
        error = HomelabError(doc["error"], doc.get("hint", ""))
        error.exit_code = int(doc.get("exit_code", 2))
        raise error
    return ExportResult.from_json(doc)


def main(argv: list[str] | None = None) -> int:
    """The export child: one JSON line on stdout, the result or ``{"error", "hint"}``."""
    parser = argparse.ArgumentParser(prog="python -m homelab_dp.app.export")
    parser.add_argument("run")
    parser.add_argument("--format", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        result = export_run(args.run, args.format, Path(args.out))
    except HomelabError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code}))
        return exc.exit_code
    print(json_safe.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
