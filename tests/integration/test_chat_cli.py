"""`homelab-dp chat MODEL` as a person (or a script) uses it: lines on stdin, answers on stdout.

Greedy answers are checked against transformers' own ``generate`` on the prompt the
conversation should have by then: after ``/reset`` and ``/system``, the second question's
prompt holds the system message and that question only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXE = Path(sys.executable).with_name("homelab-dp")
MAX_TOKENS = 8


def chat(model: str, stdin: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(EXE), "chat", model, *extra],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,  # liveness guard: it takes a few seconds
    )


def greedy_answer(model: Path, messages: list[dict[str, str]], n: int = MAX_TOKENS) -> str:
    """What the chat should print for ``messages`` (the chat template, greedy, n tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1] :]
    answer = tok.decode(new, skip_special_tokens=True)
    ended = len(new) < n or int(new[-1]) == tok.eos_token_id
    return answer + ("\n" if ended else " […]\n")


def test_chat_commands_and_streamed_answers(tiny_model: Path) -> None:
    lines = [
        "What is the capital of Foulek?",
        "/reset",
        "/system Answer briefly.",
        "/temperature 0",
        "How many millilitres in a litre?",
        "/help",
        "/quit",
        "never read",
    ]
    done = chat(str(tiny_model), "\n".join(lines) + "\n", "--max-tokens", str(MAX_TOKENS))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "(conversation reset)" in out and "(system message set)" in out
    assert "(temperature 0)" in out and "/max_tokens N" in out  # the help
    second = greedy_answer(
        tiny_model,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "How many millilitres in a litre?"},
        ],
    )
    assert "> (temperature 0)\n> " + second + "> commands:" in out
    assert "chatting with" in done.stderr


def test_eof_ends_the_chat(tiny_model: Path) -> None:
    done = chat(str(tiny_model), "Hello\n", "--temperature", "0", "--max-tokens", "3")
    assert done.returncode == 0, done.stderr
    answer = greedy_answer(tiny_model, [{"role": "user", "content": "Hello"}], 3)
    assert done.stdout == "> " + answer + "> \n"


def test_bad_model_is_exit_2(tmp_path: Path) -> None:
    done = chat(str(tmp_path / "missing"), "Hello\n")
    assert done.returncode == 2
    assert done.stderr.startswith("error: model") and "hint:" in done.stderr
    assert done.stdout == ""
    # Before torch: the answer is as quick as any bad argument.
    code = (
        "import sys\n"
        "from homelab_dp.cli.main import main\n"
        "assert main(['chat', sys.argv[1]]) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    check = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert check.stdout.strip() == "False", check.stderr
