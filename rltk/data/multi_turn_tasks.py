"""Synthetic multi-turn tasks for the tiny model: a guessing game and arithmetic through a calculator tool.

Both produce chat rows (see :mod:`rltk.data.loading`): ``messages`` holds an
episode's opening messages and ``sft_messages`` one demonstration transcript
for the supervised warm-up, whose assistant turns are the only ones trained
on. They are sized for the tiny model's context (the ``multi_turn`` recipe
gives it 256 positions): a whole demonstration is at most ~130 tokens.

* ``guess_number``: find a secret integer in ``[low, high]`` from "higher" /
  "lower" feedback (the ``guess_number`` environment gives it and the reward).
  The demonstrations are binary searches, which find any secret in at most
  ``ceil(log2(high - low + 2))`` guesses.
* ``calculator_arithmetic``: multi-digit arithmetic (three-digit sums by
  default, which the tiny model cannot do reliably in its head) solved by one
  call to the builtin ``calculator`` tool, whose result is copied into the
  answer. The demonstrations show the call in the Hermes form the tiny chat
  template renders, the tool's result and the final answer.
"""

from __future__ import annotations

import random

from rltk.data.synthetic import arithmetic

#: The opening user message of ``guess_number`` and the environment's feedback words.
GUESS_PROMPT = "guess {low}-{high}"
HIGHER, LOWER = "higher", "lower"


def guess_number(
    split: str,
    size: int,
    seed: int,
    *,
    low: int = 1,
    high: int = 31,
) -> list[dict]:
    """``size`` episodes of guessing a secret integer in ``[low, high]`` (both included).

    The opening message is ``"guess 1-31"``; the model answers with a number,
    the ``guess_number`` environment replies ``"higher"`` or ``"lower"`` until
    the number is the secret. ``extras`` holds ``secret``, ``low`` and
    ``high``; the ground truth is the secret. ``sft_messages`` is the binary
    search: guess ``(lo + hi) // 2`` of the interval still possible, which
    needs at most ``ceil(log2(high - low + 2))`` guesses (5 for 1-31).

    Unlike the arithmetic tasks there is no problem set to hold out from: the
    task teaches an interaction policy over a handful of secrets, and a secret
    never seen in training would end in a guess never demonstrated. Both
    splits therefore draw from every secret: the held-out split measures the
    policy (its first ``high - low + 1`` rows are each secret once, in a
    seeded order), the training split cycles through the secrets in shuffled
    rounds so ``size`` may exceed their number.

    Args:
        split: ``"train"`` or ``"test"`` (also ``"heldout"``, ``"eval"`` ...).
        size: number of rows.
        seed: the order of the secrets.
        low, high: the range of secrets, ``0 <= low < high <= 999``.
    """
    from rltk.data.synthetic import HELD_OUT_ALIASES, SPLITS

    if split in HELD_OUT_ALIASES:
        split = "test"
    if split not in SPLITS:
        raise ValueError(f"guess_number: split='{split}' is not valid. Valid: train, test (held out; also "
                         f"{', '.join(HELD_OUT_ALIASES)})")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"guess_number: size must be a positive integer, got {size!r}")
    if not (isinstance(low, int) and isinstance(high, int) and 0 <= low < high <= 999):
        raise ValueError(f"guess_number: need integers 0 <= low < high <= 999 (data.task_args.low/high), "
                         f"got low={low!r}, high={high!r}")
    rng = random.Random(f"guess_number|{split}|{seed}")
    secrets = list(range(low, high + 1))
    order: list[int] = []
    while len(order) < size:  # shuffled rounds: every secret once before any repeats
        round_ = secrets[:]
        rng.shuffle(round_)
        order.extend(round_)
    prompt = GUESS_PROMPT.format(low=low, high=high)
    rows = []
    for index, secret in enumerate(order[:size]):
        opening = [{"role": "user", "content": prompt}]
        rows.append({
            "prompt": prompt,
            "messages": opening,
            "sft_messages": opening + binary_search_transcript(secret, low, high),
            "ground_truth": str(secret),
            "extras": {"task": "guess_number", "secret": secret, "low": low, "high": high},
            "id": f"guess_number/{split}/{index}",
        })
    return rows


def binary_search_transcript(secret: int, low: int, high: int) -> list[dict]:
    """The assistant guesses and user feedback of a binary search for ``secret`` in ``[low, high]``.

    >>> [m["content"] for m in binary_search_transcript(3, 1, 7)]
    ['4', 'lower', '2', 'higher', '3']
    """
    messages: list[dict] = []
    lo, hi = low, high
    while True:
        guess = (lo + hi) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        if secret > guess:
            messages.append({"role": "user", "content": HIGHER})
            lo = guess + 1
        else:
            messages.append({"role": "user", "content": LOWER})
            hi = guess - 1


def calculator_arithmetic(
    split: str,
    size: int,
    seed: int,
    *,
    min_digits: int = 3,
    max_digits: int = 3,
    operators: str | list[str] = "+",
    allow_negative: bool = False,
    test_fraction: float = 0.2,
    tool: str = "calculator",
    argument: str = "expression",
) -> list[dict]:
    """``size`` arithmetic problems like ``"123+456="`` -> ``"579"``, to be solved with a tool call.

    The problems, their split and their order are those of
    :func:`rltk.data.synthetic.arithmetic` with the same arguments (so the
    held-out split never shares a problem with training). ``sft_messages``
    demonstrates the solution::

        user:      123+456=
        assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "123+456"}}</tool_call>
        tool:      579
        assistant: 579

    The assistant's call is a ``tool_calls`` entry (the chat template renders
    it); its content is empty. The reward compares the final answer with the
    ground truth (``exact_match``).

    Args:
        split, size, seed, min_digits, max_digits, operators, allow_negative,
            test_fraction: as for :func:`rltk.data.synthetic.arithmetic`.
        tool: the name of the tool the demonstrations call (``env.tools``).
        argument: the name of the tool's argument that holds the expression.
    """
    rows = []
    for row in arithmetic(split, size, seed, min_digits=min_digits, max_digits=max_digits, operators=operators,
                          allow_negative=allow_negative, test_fraction=test_fraction):
        expression = row["prompt"].rstrip("=")
        opening = [{"role": "user", "content": row["prompt"]}]
        call = {"type": "function", "function": {"name": tool, "arguments": {argument: expression}}}
        rows.append({
            "prompt": row["prompt"],
            "messages": opening,
            "sft_messages": opening + [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": row["ground_truth"]},
                {"role": "assistant", "content": row["ground_truth"]},
            ],
            "ground_truth": row["ground_truth"],
            "extras": {**row["extras"], "task": "calculator_arithmetic", "expression": expression},
            "id": "calculator_arithmetic/" + expression,
        })
    return rows
