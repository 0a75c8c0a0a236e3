"""Screen 2, Plan: choose a preset, edit its main fields in place, see the plan at once."""

from __future__ import annotations

from functools import cache

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header, Input, Label, Select, Static

from homelab_dp.app.presets import field_docs, preset_names
from homelab_dp.app.pull import NotCachedError
from homelab_dp.app.serve import plan_serving_result
from homelab_dp.errors import HomelabError
from homelab_dp.render.errors import error_text
from homelab_dp.render.plan import render_planned
from homelab_dp.render.serve_plan import serve_plan_text
from homelab_dp.tui.session import FIELDS, Session

DEBOUNCE_S = 0.3
GPUS_HELP = "What-if hardware: 2x24GiB, 24GiB,12GiB, 4x80GiB or cpu:2. Empty: the probed devices."


def field_id(key: str) -> str:
    """The widget id of a field editor: ``train.micro_batch`` → ``f-train-micro_batch``."""
    return "f-" + key.replace(".", "-")


@cache
def _docs() -> dict[str, str]:
    return field_docs()


class PlanScreen(Screen[None]):
    """Preset and field editors on the left, the plan on the right; re-planned on every change."""

    BINDINGS = [
        Binding("escape", "blur", "Leave field", show=False),
        Binding("ctrl+l", "find_seq_len", "Longest seq_len", show=False),
    ]
    AUTO_FOCUS = "#preset"

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self._timer: Timer | None = None
        self._last_error = ""
        self._names: list[str] = []
        self.plans_made = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="plan-body"):
            with VerticalScroll(id="plan-form"):
                # Widgets start with the session's values: a Select posts Changed for its
                # first value, which would otherwise switch the preset back to the first one.
                s = self.session
                names = self._names = preset_names()
                yield Select(
                    [(n, n) for n in names],
                    value=s.preset_name if s.preset_name in names else Select.NULL,
                    id="preset",
                    compact=True,
                    allow_blank=not names,
                )
                with Horizontal(classes="row"):
                    yield Label("--gpus")
                    yield Input(s.gpus, placeholder="probe", id="gpus", compact=True)
                for f in FIELDS:
                    with Horizontal(classes="row"):
                        yield Label(f.label)
                        value = s.value(f.key)
                        if f.kind == "choice":
                            yield Select(
                                [(c, c) for c in f.choices],
                                value=value if value in f.choices else f.choices[0],
                                id=field_id(f.key),
                                compact=True,
                                allow_blank=False,
                            )
                        else:
                            kind = "integer" if f.kind == "int" else "text"
                            yield Input(value, id=field_id(f.key), type=kind, compact=True)
                yield Static(id="field-help")
            with VerticalScroll(id="plan-out"):
                yield Static(id="plan-view")
                yield Static(id="serve-view")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "2 Plan"
        self.replan()

    def on_screen_resume(self) -> None:
        if not self.is_mounted:
            return
        names = preset_names()
        if names != self._names:
            self._names = names
            select = self.query_one("#preset", Select)
            with self.prevent(Select.Changed):  # a preset saved on Launch joins the list
                select.set_options([(n, n) for n in names])
                if self.session.preset_name in names:
                    select.value = self.session.preset_name
        self.replan()  # Launch may have changed the extra overrides

    # ------------------------------------------------------------------ editors
    def fill(self) -> None:
        """Put the session's preset and values into the editors without re-planning each."""
        with self.prevent(Input.Changed, Select.Changed):
            if self.session.preset_name:
                self.query_one("#preset", Select).value = self.session.preset_name
            self.query_one("#gpus", Input).value = self.session.gpus
            for f in FIELDS:
                value = self.session.value(f.key)
                if f.kind == "choice":
                    widget = self.query_one(f"#{field_id(f.key)}", Select)
                    widget.value = value if value in f.choices else f.choices[0]
                else:
                    self.query_one(f"#{field_id(f.key)}", Input).value = value

    def _key(self, widget_id: str | None) -> str | None:
        for f in FIELDS:
            if field_id(f.key) == widget_id:
                return f.key
        return None

    @on(Select.Changed, "#preset")
    def _preset_chosen(self, event: Select.Changed) -> None:
        name = str(event.value)
        if name == self.session.preset_name:
            return
        try:
            self.session.load(name)
        except HomelabError as exc:
            self._show_error(exc)
            return
        self.fill()
        self.replan()

    @on(Select.Changed)
    def _choice_changed(self, event: Select.Changed) -> None:
        key = self._key(event.select.id)
        if key is not None:
            self.session.edits[key] = str(event.value)
            self.replan()

    @on(Input.Changed)
    def _text_changed(self, event: Input.Changed) -> None:
        if event.input.id == "gpus":
            self.session.gpus = event.value.strip()
        else:
            key = self._key(event.input.id)
            if key is None:
                return
            self.session.edits[key] = event.value
        if self._timer is not None:
            self._timer.stop()
        # Re-plan once typing pauses, from the cache only: a half-typed model id is no download
        self._timer = self.set_timer(DEBOUNCE_S, lambda: self.replan(fetch=False))

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.replan()

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        widget_id = event.widget.id
        key = self._key(widget_id)
        if widget_id == "gpus":
            text = GPUS_HELP
        elif widget_id == "preset":
            text = "The preset to plan; the fields below start from its values."
        else:
            text = f"{key}: {_docs().get(key, '')}" if key else ""
            if key == "data.seq_len":
                text += " ctrl+l: the longest that fits (plan --find-seq-len)."
        self.query_one("#field-help", Static).update(Text(text, style="italic"))

    def action_blur(self) -> None:
        """Leave the field, so that number keys switch screens again."""
        self.set_focus(None)

    def action_find_seq_len(self) -> None:
        """Plan once more with the longest data.seq_len that fits (`plan --find-seq-len`)."""
        self.replan(find_seq_len=True)

    # ------------------------------------------------------------------ planning
    def replan(self, fetch: bool = True, *, find_seq_len: bool = False) -> None:
        """Plan the session's choices (milliseconds: no torch) and show the result. ``fetch``:
        a model id's config.json may be downloaded (not while typing: Enter fetches it).
        ``find_seq_len`` (ctrl+l): with the sequence-length finder's answer."""
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        view = self.query_one("#plan-view", Static)
        serving = self.query_one("#serve-view", Static)
        serving.update("")
        if not self.session.preset_name:
            view.update("No preset found: put one in ./presets or save one from Launch.")
            return
        try:
            planned = self.session.plan(fetch=fetch, find_seq_len=find_seq_len)
        except NotCachedError as exc:
            hint = "press Enter in the model field to download its config.json" if not fetch else ""
            self._show_error(HomelabError(exc.message, hint or exc.hint))
            return
        except HomelabError as exc:
            self._show_error(exc)
            return
        self.plans_made += 1
        self._last_error = ""
        view.update(render_planned(planned))
        # The result's serving plan on the same devices: pure arithmetic, no model read.
        serving.update(serve_plan_text(planned.spec, plan_serving_result(planned)))

    def _show_error(self, exc: HomelabError) -> None:
        text = error_text(exc)
        self.query_one("#plan-view", Static).update(Text(text, style="bold red"))
        self.query_one("#serve-view", Static).update("")
        if text != self._last_error:  # typing must not pile up the same notification
            self.app.notify(text, severity="error", timeout=10, markup=False)
        self._last_error = text
