"""A conversation with one loaded model, in-process: what `homelab-dp chat` (and a chat screen) keeps.

It holds the system message, the turns so far and the sampling settings, renders them with the
model's template (`prompting`), and generates the answer with the `Engine`, text streamed to a
callback. A conversation longer than the context loses its oldest turns (the system message
stays) until the prompt leaves room for ``max_tokens``, or at least one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from homelab_dp.errors import HomelabError
from homelab_dp.serving.replica.generation_engine import Engine, Request, Result
from homelab_dp.serving.replica.prompt_templates import Template, eos_ids, prompt_ids
from homelab_dp.serving.replica.result_model import Loaded


@dataclass
class Conversation:
    """The turns of one chat and how to answer them."""

    loaded: Loaded
    """The model and tokenizer."""
    template: Template
    """How messages become the prompt."""
    temperature: float = 0.7
    """0: greedy."""
    max_tokens: int = 256
    """Most tokens per answer."""
    system: str = ""
    """The system message ("" for none)."""
    turns: list[dict[str, str]] = field(default_factory=list)
    """User and assistant messages so far."""
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

    def reset(self) -> None:
        """Forget the turns (the system message and settings stay)."""
        self.turns.clear()

    def messages(self) -> list[dict[str, str]]:
        """The conversation as the template receives it."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def _fitting_prompt(self) -> list[int]:
        """The prompt's ids, dropping the oldest turns while it leaves too little room."""
        context = self.loaded.context
        while True:
            ids = prompt_ids(
                self.loaded.tokenizer, messages=self.messages(), template=self.template
            )
            room = context - len(ids)
            if room >= self.max_tokens or (room >= 1 and len(self.turns) <= 1):
                return ids
            if len(self.turns) <= 1:
                raise HomelabError(
                    f"the message takes {len(ids)} tokens; the model's context is {context}",
                    hint="send a shorter message (or a shorter /system text)",
                )
            del self.turns[: 2 if self.turns[0]["role"] == "user" else 1]

    def ask(self, text: str, on_text: Callable[[str], None]) -> Result:
        """Add the user's message, generate the answer (its text streamed to ``on_text``)."""
        self.turns.append({"role": "user", "content": text})
        try:
            ids = self._fitting_prompt()
        except HomelabError:
            self.turns.pop()
            raise
        request = Request(
            prompt_ids=ids,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop=self.template.stop,
            emit=lambda event: on_text(event["text"]) if "text" in event else None,
        )
        result = self.engine.generate([request])[0]
        self.turns.append({"role": "assistant", "content": result.text})
        return result
