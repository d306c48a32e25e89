"""The multiple-choice reward: does the response name the right option, and no other?

For tasks whose answer is one of a few named options (the colour of a shape, a side, a count, A-D): the
response's first line, read as words, must name the ground truth and none of the other options. Naming
every option (``"red green blue"``) is a hedge that an any-match reward would pay in full, and a policy
learns such hedges fast; here it scores 0.

The work per call is bounded whatever the response's length: only the first :data:`MAX_ANSWER_CHARS`
characters are looked at, and words are split with one linear-time regex.
"""

from __future__ import annotations

import re

from rltk.rewards.marks import bounded

#: The longest first line looked at; the options of a multiple-choice answer are a few words.
MAX_ANSWER_CHARS = 256
_WORD = re.compile(r"[^\W_]+")


@bounded
def multiple_choice(
    *,
    prompt: str,
    response: str,
    ground_truth: str,
    extras: dict,
    choices: list[str] | None = None,
) -> float:
    """1.0 when the response's first line names the ground truth and no other option, else 0.0.

    Options are ``choices`` when configured, else the row's ``extras["choices"]`` (``shape_colour`` rows
    carry them), else the ground truth alone (any other word is then allowed). Words are compared
    case-insensitively, punctuation ignored: ``"Red."`` names ``red``; an option of several words
    (``"light blue"``) must appear as those consecutive words, and words that name it do not name an option
inside it (``"blue"``) as well. Only the first :data:`MAX_ANSWER_CHARS`
    characters of the first line count.
    """
    truth = tuple(_words(ground_truth))
    if not truth:
        return 0.0
    given = choices if choices is not None else (extras or {}).get("choices") or []
    options = {tuple(_words(option)) for option in given} | {truth}
    words = _words(response.lstrip()[:MAX_ANSWER_CHARS].split("\n", 1)[0])
    return float(_named(words, options) == {truth})


def _words(text: str) -> list[str]:
    return [word.casefold() for word in _WORD.findall(str(text)[:MAX_ANSWER_CHARS])]


def _named(words: list[str], options: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
    """The options the words name, longest first: words that name ``light blue`` do not name ``blue`` too."""
    taken = [False] * len(words)
    named = set()
    for option in sorted((o for o in options if o), key=len, reverse=True):
        n = len(option)
        for i in range(len(words) - n + 1):
            if tuple(words[i:i + n]) == option and not any(taken[i:i + n]):
                taken[i:i + n] = [True] * n
                named.add(option)
    return named
