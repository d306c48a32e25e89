"""Wordle for multi-turn RL: the rules, the environment, a helper tool and a task.

The game: a hidden word of ``n`` letters; each assistant turn is a guess of
``n`` letters, answered with one feedback mark per position:

* ``G`` the letter is in the word at this position (green);
* ``Y`` the letter is in the word elsewhere (yellow), counted with
  multiplicity: a letter the word holds ``k`` times is marked (G or Y) at most
  ``k`` times, greens first, then yellows from left to right;
* ``-`` otherwise.

Rewards per turn (``Experience.turn_rewards``): the progress in greens,
``max(0, g_t - best_{t-1}) / n`` where ``g_t`` is the number of greens of
guess ``t`` and ``best_{t-1}`` the most greens of any earlier guess (0 before
the first). They telescope: an episode's environment reward is its best
guess's fraction of greens, 1.0 exactly when it solved the word. An invalid
guess (wrong length, a character outside a-z) earns ``invalid_reward`` and
uses up a guess.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from rltk.environments.base import AssistantTurn, Environment, StepResult
from rltk.tools.base import tool

#: The words the task draws secrets from and the tool searches (lowercase, five letters, no repeats in the list).
WORDS: tuple[str, ...] = (
    "about", "above", "actor", "adapt", "alarm", "album", "alert", "apple", "arena", "badge",
    "baker", "beach", "bench", "black", "blade", "blank", "block", "board", "brain", "brave",
    "bread", "brick", "brown", "build", "cabin", "candy", "chain", "chair", "chalk", "charm",
    "chart", "chess", "chest", "child", "claim", "class", "clean", "clock", "cloud", "coast",
    "crane", "cream", "dance", "diary", "dream", "drink", "eagle", "earth", "fault", "field",
    "flame", "float", "floor", "fruit", "ghost", "glass", "grape", "green", "house", "judge",
    "knife", "laser", "lemon", "light", "magic", "march", "metal", "money", "mouse", "music",
    "night", "ocean", "paint", "piano", "plant", "queen", "river", "robot", "salad", "smile",
    "snake", "stone", "sugar", "table", "tiger", "toast", "train", "water", "whale", "zebra",
)

_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")


def feedback(secret: str, guess: str) -> str:
    """The marks of ``guess`` against ``secret`` (equal lengths): a string of ``G``, ``Y`` and ``-``.

    Two passes, as the game scores repeated letters: greens first, then each
    remaining position from left to right is yellow while the secret still
    has an unmatched copy of that letter.
    """
    if len(secret) != len(guess):
        raise ValueError(f"feedback: secret and guess must have the same length, got {len(secret)} and {len(guess)}")
    marks = ["G" if s == g else "-" for s, g in zip(secret, guess)]
    unmatched = Counter(s for s, m in zip(secret, marks) if m != "G")
    for i, letter in enumerate(guess):
        if marks[i] != "G" and unmatched[letter] > 0:
            marks[i] = "Y"
            unmatched[letter] -= 1
    return "".join(marks)


def parse_history(history: str) -> list[tuple[str, str]]:
    """``"crane -G-Y-; slate --G--"`` as ``[("crane", "-G-Y-"), ("slate", "--G--")]``.

    Entries are separated by ``;`` or newlines, each a guess and its marks
    separated by whitespace. Raises ``ValueError`` saying which entry is
    malformed and why (the tool shows it to the model).
    """
    if not isinstance(history, str):
        raise ValueError(f"history must be a string like 'crane -G-Y-; slate --G--', got {type(history).__name__}")
    entries = []
    for index, part in enumerate(p.strip() for p in history.replace("\n", ";").split(";")):
        if not part:
            continue
        fields = part.split()
        if len(fields) != 2:
            raise ValueError(f"entry {index + 1} {part!r} must be a guess and its marks, e.g. 'crane -G-Y-'")
        guess, marks = fields[0].lower(), fields[1].upper()
        if not set(guess) <= _LETTERS or not set(marks) <= set("GY-") or len(guess) != len(marks):
            raise ValueError(f"entry {index + 1} {part!r}: the guess must be letters a-z and the marks as many "
                             f"of G, Y and -")
        entries.append((guess, marks))
    if not entries:
        raise ValueError("history is empty; give at least one 'guess marks' entry, e.g. 'crane -G-Y-'")
    return entries


def candidates(history: Sequence[tuple[str, str]], words: Sequence[str]) -> list[str]:
    """The ``words`` that could be the secret: those that give every guess of ``history`` its marks.

    A word ``w`` is consistent exactly when ``feedback(w, guess) == marks``
    for every ``(guess, marks)``; words of another length never are.
    """
    return [w for w in words
            if all(len(w) == len(guess) and feedback(w, guess) == marks for guess, marks in history)]


@tool(parameters={
    "type": "object",
    "properties": {"history": {"type": "string",
                               "description": "your guesses with their marks, e.g. 'crane -G-Y-; slate --G--'"}},
    "required": ["history"],
})
def wordle_candidates(history: str, *, words: list | None = None, limit: int = 8) -> str:
    """List the words still possible after the given Wordle guesses and their G/Y/- marks.

    Searches ``words`` (default :data:`WORDS`; configurable as
    ``env.tools_args.wordle_candidates.words``) and returns at most ``limit``
    of them, space-separated, with ``(+k more)`` when more match, or
    ``none``. A malformed history raises, which the workflow shows the model
    as an error observation.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"env.tools_args.wordle_candidates.limit must be an integer >= 1, got {limit!r}")
    found = candidates(parse_history(history), WORDS if words is None else [str(w).lower() for w in words])
    if not found:
        return "none"
    more = f" (+{len(found) - limit} more)" if len(found) > limit else ""
    return " ".join(found[:limit]) + more


class Wordle(Environment):
    """Wordle: guess the row's hidden word (``ground_truth``) from G/Y/- feedback, per-turn rewards on greens.

    One instance per episode (built as ``Wordle(**env.environment_args)``).
    Each turn's text, stripped and lowercased, is the guess; the observation
    is a user message ``"<guess> <marks>"`` (e.g. ``"crane -G-Y-"``), or
    ``"invalid <guess>: guess N letters a-z"``. Rewards: see the module
    docstring. The episode ends when the word is solved or after
    ``max_guesses`` guesses (``info["solved"]`` says which).

    Args:
        max_guesses: guesses per episode, invalid ones included (keep
            ``env.max_turns`` at least this, or the workflow cuts the
            episode first and flags it truncated).
        invalid_reward: the reward of an invalid guess (a penalty, <= 0 usually).
    """

    def __init__(self, max_guesses: int = 6, invalid_reward: float = -0.1):
        if isinstance(max_guesses, bool) or not isinstance(max_guesses, int) or max_guesses < 1:
            raise ValueError(f"env.environment_args.max_guesses must be an integer >= 1, got {max_guesses!r}")
        if isinstance(invalid_reward, bool) or not isinstance(invalid_reward, (int, float)):
            raise ValueError(f"env.environment_args.invalid_reward must be a number, got {invalid_reward!r}")
        self.max_guesses = max_guesses
        self.invalid_reward = float(invalid_reward)
        self.secret = ""
        self.guesses = 0
        self.best_greens = 0

    def reset(self, row: dict) -> list[dict]:
        """The opening user message: the row's ``messages`` or ``prompt``, else ``"wordle N"``."""
        truth = row.get("ground_truth")
        secret = truth.strip().lower() if isinstance(truth, str) else ""
        if not secret or not set(secret) <= _LETTERS:
            raise ValueError(f"wordle: row {row.get('id', '?')!r} needs a ground_truth of letters a-z (the hidden "
                             f"word), got {row.get('ground_truth')!r}")
        self.secret, self.guesses, self.best_greens = secret, 0, 0
        if row.get("messages"):
            return [dict(m) for m in row["messages"]]
        prompt = row.get("prompt")
        return [{"role": "user", "content": prompt if isinstance(prompt, str) and prompt else f"wordle {len(secret)}"}]

    def step(self, turn: AssistantTurn) -> StepResult:
        """Mark the guess; reward the new greens (``/ n``); done when solved or out of guesses."""
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        guess = turn.text.strip().lower()
        n = len(self.secret)
        if len(guess) != n or not set(guess) <= _LETTERS:
            return StepResult(observation=[{"role": "user", "content": f"invalid {guess[:n + 4]}: guess {n} letters a-z"}],
                              reward=self.invalid_reward, done=out_of_guesses,
                              info={"guess": guess[:n + 4], "valid": False, "solved": False})
        marks = feedback(self.secret, guess)
        greens = marks.count("G")
        reward = max(0, greens - self.best_greens) / n
        self.best_greens = max(self.best_greens, greens)
        solved = greens == n
        return StepResult(observation=[{"role": "user", "content": f"{guess} {marks}"}], reward=reward,
                          done=solved or out_of_guesses,
                          info={"guess": guess, "marks": marks, "valid": True, "solved": solved})


#: Names of the held-out split (rltk asks tasks for ``"test"``; some callers say ``"heldout"`` or ``"eval"``).
HELD_OUT_SPLITS = ("test", "heldout", "held_out", "eval", "validation", "val")


def wordle_task(split: str, size: int, seed: int, *, words: list | None = None, prompt: str = "wordle") -> list[dict]:
    """``size`` Wordle rows of ``split`` (``"train"``, or ``"test"`` and its aliases in
    :data:`HELD_OUT_SPLITS`): hidden words drawn with ``seed``.

    The two splits never share a word whatever the seeds: every fifth word of
    the list (``words``, default :data:`WORDS`) is held out for ``"test"``,
    the rest are ``"train"``'s. Words are drawn uniformly with replacement.
    A row is ``{"id", "prompt", "ground_truth": word, "extras": {}}``.
    """
    if split != "train" and split not in HELD_OUT_SPLITS:
        raise ValueError(f"wordle_task: split must be 'train' or 'test' (or {', '.join(HELD_OUT_SPLITS[1:])}), "
                         f"got {split!r}")
    split = "train" if split == "train" else "test"
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"data.train_size / data.eval_size must be an integer >= 0, got {size!r}")
    pool = [str(w).strip().lower() for w in (WORDS if words is None else words)]
    bad = [w for w in pool if not w or not set(w) <= _LETTERS]
    if bad:
        raise ValueError(f"data.task_args.words: every word must be letters a-z, got {bad[0]!r}")
    pool = [w for i, w in enumerate(pool) if (i % 5 == 0) == (split == "test")]
    if not pool:
        raise ValueError(f"data.task_args.words: the {split} split is empty (every fifth word is held out for "
                         f"test); give at least 2 words")
    rng = random.Random(f"wordle-{split}-{seed}")
    return [{"id": f"wordle-{split}-{seed}-{i}", "prompt": prompt, "ground_truth": rng.choice(pool), "extras": {}}
            for i in range(size)]
