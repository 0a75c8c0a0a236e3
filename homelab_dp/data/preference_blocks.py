"""Preference data as training blocks: pairs (DPO, ORPO) and labelled completions (KTO); no torch.

The pipeline mirrors SFT's (`homelab_dp.data.blocks`): a data set (`homelab_dp.data.sources`,
any file, folder or Hub id) → validated records (`homelab_dp.data.records`, formats
``preference`` and ``kto``) → tokenized pairs (`homelab_dp.data.tokenize.tokenize_pairs`, kept
in the token cache, `homelab_dp.data.token_cache.write_pairs`) → `PairBlock` s (here).

A pair is a prompt and two responses (chosen, rejected); a KTO record is a prompt, one
completion and its label (desirable or not), and a second, mismatched "KL" completion: the same
prompt with the completion of another record, fixed here (the next record in the order
``train.seed`` shuffles the data into), so it never depends on how a batch is split.

Each sequence (prompt + response, eos at the end) takes its tokens but the last as inputs, as
an SFT sample does, and must fit ``data.seq_len`` inputs: a response that does not fit is
truncated; a prompt that leaves no room for a response token is a `DataError` naming its
``file:line``. Labels are shifted like `homelab_dp.data.blocks.Block.labels` (``labels[t]`` is
the target of position t) and are -100 outside the responses.

- **pack = true**: whole pairs are best-fit packed (`homelab_dp.data.blocks.best_fit_decreasing`,
  longest first) into ONE row of ``2 · seq_len`` tokens: chosen then rejected, each sequence's
  positions restarting at 0, so transformers' packed-sequence detection keeps attention inside
  each sequence (exact); the padding at the end is a run of its own (label -100, mask 0,
  sequence -1).
- **pack = false**: one pair per block, two rows of ``seq_len`` (row 0 chosen, row 1 rejected),
  padded, with an attention mask.

Pairs whose chosen and rejected responses are the same tokens carry no signal: they are left
out and counted (`PreferenceTrainEval.identical`; `identical_warning` says it once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from homelab_dp.data.tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAIR_OBJECTIVES = ("dpo", "orpo")
"""The objectives that train on chosen/rejected pairs (data format ``preference``)."""
KTO_OBJECTIVES = ("kto",)
"""The objectives that train on labelled completions (data format ``kto``)."""


@dataclass
class PairBlock:
    """One block of preference data: the loop indexes it as it does an SFT block."""

    input_ids: list[list[int]]
    """Rows × row length: one row of 2·seq_len (packed) or two rows of seq_len (unpacked)."""
    labels: list[list[int]]
    """Shifted like SFT's: labels[r][t] is the target of position t; -100 outside responses."""
    attention_mask: list[list[int]]
    """1 for a real token, 0 for padding."""
    position_ids: list[list[int]]
    """Restart at 0 at the start of every sequence (and of the padding run)."""
    sequence: list[list[int]]
    """Per position: 2k = the chosen sequence of the block's pair k, 2k+1 = its rejected one
    (KTO: 2k = the completion, 2k+1 = its mismatched KL completion); -1 on padding."""
    desirable: list[int] = field(default_factory=list)
    """KTO only: per pair k, 1 desirable / 0 undesirable; [] for pairs."""
    n_pairs: int = 0
    """Pairs (KTO: completions) in this block: the loss's unit count."""

    @property
    def num_targets(self) -> int:
        """Tokens with a label, over every row (both sequences of every pair)."""
        return sum(t != IGNORE_INDEX for row in self.labels for t in row)

    @property
    def row_len(self) -> int:
        """Tokens per row."""
        return len(self.input_ids[0]) if self.input_ids else 0


@dataclass
class PreferenceTrainEval:
    """The preference blocks to train and evaluate on (`load_preference_train_eval`)."""

    train: list[PairBlock]
    eval: list[PairBlock]
    """Empty: no eval data."""
    fmt: str = ""
    """The data's format: ``preference`` or ``kto``."""
    cache: tuple[str, ...] = ()
    """How this process had each data set's pairs: ``hit`` (token cache) or ``built``, the
    training data first."""
    identical: int = 0
    """Pairs left out because chosen and rejected are the same tokens (training and eval data)."""
    held_out: int = 0
    """Pairs (KTO: records) held out by data.eval_fraction, else 0."""
    label: str = ""
    """What messages call the training data (its file, or ``FOLDER (split NAME)``)."""


def load_preference_train_eval(
    data_cfg: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    objective: str,
    seed: int,
    seq_len_limit: int | None,
    min_blocks: int,
) -> PreferenceTrainEval:
    """The training blocks (at least ``min_blocks``) and eval blocks of a [data] section for
    a preference ``objective`` (dpo, orpo: pairs; kto: labelled completions), mirroring
    `homelab_dp.data.eval_split.load_train_eval`. Raises DataError (file:line or row, hint)."""
    raise NotImplementedError  # the body lands next; the signature is the contract
