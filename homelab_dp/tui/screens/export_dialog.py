"""The Runs screen's export dialog: a format and an output folder (enter exports, escape
cancels). The export itself runs where the Runs screen puts it (a child process)."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Select

from homelab_dp.app.export import FORMATS

FORMAT_WORDS = {
    "hf": "hf: a standalone Hugging Face model folder",
    "adapter": "adapter: the PEFT adapter folder",
    "merged": "merged: adapter merged in the run's dtype",
    "ollama": "ollama: merged + a Modelfile",
    "gguf": "gguf: llama.cpp's converter (LLAMA_CPP_DIR)",
}


def default_out(run_id: str, fmt: str, where: Path | None = None) -> Path:
    """Where an export goes unless the folder is changed: ``./exports/<run>-<format>``."""
    return (where or Path.cwd()) / "exports" / f"{run_id}-{fmt}"


class ExportDialog(ModalScreen[tuple[str, Path] | None]):
    """Dismissed with (format, folder) on enter, None on escape."""

    DEFAULT_CSS = """
    ExportDialog { align: center middle; }
    #export { width: 76; height: auto; border: thick $primary; background: $surface;
              padding: 1 2; }
    #export .export-row { height: 3; }
    #export .export-row > Label { width: 9; padding-top: 1; }
    #export .export-row > Input, #export .export-row > Select { width: 1fr; }
    #export-keys { margin-top: 1; color: $text-muted; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, run_id: str, fmt: str = "merged", where: Path | None = None) -> None:
        super().__init__()
        self.run_id = run_id
        self.fmt = fmt
        self.where = where

    def compose(self) -> ComposeResult:
        options = [(FORMAT_WORDS[f], f) for f in FORMATS]
        with Vertical(id="export"):
            yield Label(f"Export run {self.run_id}")
            with Horizontal(classes="export-row"):
                yield Label("format")
                yield Select(options, value=self.fmt, allow_blank=False, id="export-format")
            with Horizontal(classes="export-row"):
                yield Label("folder")
                yield Input(str(default_out(self.run_id, self.fmt, self.where)), id="export-out")
            yield Label(
                "[b]enter[/b] export    [b]tab[/b] format / folder    [b]escape[/b] cancel",
                id="export-keys",
            )

    def on_mount(self) -> None:
        self.query_one("#export-out", Input).focus()

    @on(Select.Changed, "#export-format")
    def _format_changed(self, event: Select.Changed) -> None:
        """A folder still at the default follows the format (`…-merged` → `…-ollama`)."""
        out = self.query_one("#export-out", Input)
        if out.value == str(default_out(self.run_id, self.fmt, self.where)):
            out.value = str(default_out(self.run_id, str(event.value), self.where))
        self.fmt = str(event.value)

    @on(Input.Submitted, "#export-out")
    def _submit(self) -> None:
        folder = self.query_one("#export-out", Input).value.strip()
        if folder:
            fmt = str(self.query_one("#export-format", Select).value)
            self.dismiss((fmt, Path(folder).expanduser()))

    def action_cancel(self) -> None:
        """Close without exporting."""
        self.dismiss(None)
