"""The in-process back end of a chat (`app.chat_session.ChatSession`): a model loaded here.

What `homelab-dp chat` answers with: the model and tokenizer loaded in this process
(`serving.replica.result_model`), the session's messages rendered with the model's template
(`prompting`), and the answer generated with the `Engine`, text streamed to a callback. A
conversation longer than the context loses its oldest turns (the system message stays) until the
prompt leaves room for ``max_tokens``, or at least one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.runs.model_ref import ModelRef
from homelab_dp.serving.replica.generation_engine import Engine, Request, Result
from homelab_dp.serving.replica.prompt_templates import (
    Template,
    eos_ids,
    prompt_ids,
    template_for,
)
from homelab_dp.serving.replica.result_model import Loaded, default_device, load_for_inference


@dataclass
class InProcess:
    """A loaded model and how to answer a session with it."""

    loaded: Loaded
    """The model and tokenizer."""
    template: Template
    """How messages become the prompt."""
    name: str = ""
    """What the user called the model."""
    seed: int | None = None
    """Seeds each answer's sampler (None: random)."""

    def __post_init__(self) -> None:
        loaded = self.loaded
        self.engine = Engine(
            loaded.model,
            loaded.tokenizer,
            context=loaded.context,
            eos_ids=eos_ids(loaded.tokenizer, loaded.model),
            device=loaded.device,
        )

    @classmethod
    def load(cls, ref: ModelRef, device: str | None = None) -> InProcess:
        """Load ``ref`` on ``device`` (default: the first visible GPU, else the CPU)."""
        loaded = load_for_inference(ref, device or default_device())
        return cls(loaded, template_for(loaded.tokenizer, ref), name=ref.name)

    def describe(self) -> str:
        """The model, where it runs, its template and context, in words."""
        return (
            f"{self.name} on {self.loaded.device} ({self.template.kind} template, context "
            f"{self.loaded.context})"
        )

    def _fitting_prompt(self, session: Any) -> list[int]:
        """The prompt's ids, dropping the session's oldest turns while it leaves too little
        room."""
        context = self.loaded.context
        turns = session.turns
        while True:
            ids = prompt_ids(
                self.loaded.tokenizer, messages=session.messages(), template=self.template
            )
            room = context - len(ids)
            if room >= session.max_tokens or (room >= 1 and len(turns) <= 1):
                return ids
            if len(turns) <= 1:
                raise HomelabError(
                    f"the message takes {len(ids)} tokens; the model's context is {context}",
                    hint="send a shorter message (or a shorter /system text)",
                )
            del turns[: 2 if turns[0]["role"] == "user" else 1]

    def answer(self, session: Any, on_text: Callable[[str], None]) -> Result:
        """Generate the answer to ``session``'s last message (a `ChatSession`), its text
        streamed to ``on_text``. Raises HomelabError."""
        request = Request(
            prompt_ids=self._fitting_prompt(session),
            max_tokens=session.max_tokens,
            temperature=session.temperature,
            seed=self.seed,
            stop=self.template.stop,
            emit=lambda event: on_text(event["text"]) if "text" in event else None,
        )
        return self.engine.generate([request])[0]
