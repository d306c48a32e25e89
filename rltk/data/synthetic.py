"""Synthetic verifiable tasks: arithmetic and Countdown, deterministic by seed.

Every row has the standard form ``{"prompt", "ground_truth", "extras", "id"}``
(see :mod:`rltk.data.loading`); ``extras["solution"]`` (or, when a row has
none, the ground truth) is a correct response for a supervised warm-up
(:func:`sft_examples`).

Train and held-out splits are disjoint by construction, whatever the seeds:
a problem belongs to the held-out split ``"test"`` exactly when a hash of its
canonical key (``3+5`` and ``5+3`` share one; a Countdown puzzle's key is its
sorted numbers and target) falls below ``test_fraction``. Seeds only choose
which problems of a split are drawn, so ``split="train", seed=1`` and
``split="test", seed=2`` can never share a problem, as long as both use the
same ``test_fraction``.
"""

from __future__ import annotations

import hashlib
import inspect
import random
from collections.abc import Callable

from rltk.data.templates import fill_template, template_fields

SPLITS = ("train", "test")
#: Other names accepted for the held-out split.
HELD_OUT_ALIASES = ("heldout", "held_out", "eval", "validation", "val")
ARITHMETIC_OPERATORS = ("+", "-", "*")
COUNTDOWN_RULES = ("exactly_once", "at_most_once")

# Below this many candidate problems the generator enumerates them all (so it
# can say exactly how many a split holds); above it, rejection sampling is fast.
_ENUMERATION_LIMIT = 200_000

#: Default Countdown prompt: short, because the tiny default model has 256 positions.
#: The fields a Countdown prompt template may use.
COUNTDOWN_TEMPLATE_FIELDS = ("numbers", "numbers_list", "target", "rule_text")
COUNTDOWN_COMPACT_TEMPLATE = "Make {target} from {numbers}.\n"
#: A spelled-out Countdown prompt for pretrained instruction-following models.
COUNTDOWN_INSTRUCT_TEMPLATE = (
    "Combine the numbers {numbers_list} with +, -, * and / (parentheses allowed) so that the "
    "result is {target}. {rule_text} Think inside <think> </think>, then write only the equation, "
    "without '= {target}', inside <answer> </answer>."
)
_RULE_TEXT = {
    "exactly_once": "Use every number exactly once.",
    "at_most_once": "Use each number at most once; you may leave numbers out.",
}


def is_held_out(key: str, test_fraction: float) -> bool:
    """Whether the problem with canonical ``key`` belongs to the held-out split.

    A keyed hash (blake2b) of the key, read as a number in [0, 1), compared
    with ``test_fraction``: stable across processes, platforms and seeds.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"rltk-split").digest()
    return int.from_bytes(digest, "big") / 2.0**64 < test_fraction


def arithmetic(
    split: str,
    size: int,
    seed: int,
    *,
    min_digits: int = 1,
    max_digits: int = 2,
    operators: str | list[str] = "+",
    allow_negative: bool = False,
    test_fraction: float = 0.2,
) -> list[dict]:
    """``size`` distinct problems like ``"17+25="`` -> ``"42"``.

    Operands are drawn uniformly from the integers with ``min_digits`` to
    ``max_digits`` digits (``0..99`` by default); the operator uniformly from
    ``operators``. Subtraction whose result would be negative is left out
    unless ``allow_negative``.

    Args:
        split: ``"train"`` or ``"test"`` (held out; see the module docstring;
            ``"heldout"``, ``"eval"``, ``"validation"`` mean ``"test"``).
        size: number of rows; an error says how many exist if too few do.
        seed: which problems are drawn and in which order.
        min_digits, max_digits: operand digit counts.
        operators: any of ``+ - *``, as a string (``"+-"``) or list.
        allow_negative: keep subtractions with negative results.
        test_fraction: share of all problems held out for ``"test"``.
    """
    split = _check_common("arithmetic", split, size, test_fraction)
    ops = list(dict.fromkeys(operators))
    bad = [op for op in ops if op not in ARITHMETIC_OPERATORS]
    if bad or not ops:
        raise ValueError(
            f"arithmetic: operators={operators!r} is not valid; choose from {' '.join(ARITHMETIC_OPERATORS)}"
        )
    if not (isinstance(min_digits, int) and isinstance(max_digits, int) and 1 <= min_digits <= max_digits <= 9):
        raise ValueError(
            f"arithmetic: need 1 <= min_digits <= max_digits <= 9, got min_digits={min_digits}, "
            f"max_digits={max_digits}"
        )
    low = 0 if min_digits == 1 else 10 ** (min_digits - 1)
    high = 10**max_digits - 1

    def valid(a: int, op: str, b: int) -> bool:
        return allow_negative or op != "-" or a >= b

    def canonical_key(a: int, op: str, b: int) -> str:
        if op in "+*":  # commutative: 3+5 and 5+3 must land in the same split
            a, b = min(a, b), max(a, b)
        return f"{a}{op}{b}"

    rng = random.Random(f"arithmetic|{split}|{seed}")
    want_test = split == "test"
    space = len(ops) * (high - low + 1) ** 2
    problems: list[tuple[int, str, int]]
    if space <= _ENUMERATION_LIMIT:
        candidates = [
            (a, op, b)
            for op in ops for a in range(low, high + 1) for b in range(low, high + 1)
            if valid(a, op, b) and is_held_out(canonical_key(a, op, b), test_fraction) == want_test
        ]
        if size > len(candidates):
            raise ValueError(
                f"arithmetic: size={size} but the '{split}' split has only {len(candidates)} distinct problems "
                f"with digits {min_digits}-{max_digits}, operators {''.join(ops)} and "
                f"test_fraction={test_fraction}; lower size or widen max_digits/operators"
            )
        problems = rng.sample(candidates, size)
    else:
        problems, seen = [], set()
        for _ in range(100 * size + 10_000):
            a, op, b = rng.randint(low, high), rng.choice(ops), rng.randint(low, high)
            if (a, op, b) in seen or not valid(a, op, b):
                continue
            if is_held_out(canonical_key(a, op, b), test_fraction) != want_test:
                continue
            seen.add((a, op, b))
            problems.append((a, op, b))
            if len(problems) == size:
                break
        else:
            raise ValueError(f"arithmetic: could not draw {size} distinct '{split}' problems; lower size")
    rows = []
    for a, op, b in problems:
        result = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({
            "prompt": f"{a}{op}{b}=",
            "ground_truth": str(result),
            "extras": {"task": "arithmetic", "a": a, "b": b, "op": op},
            "id": f"arithmetic/{a}{op}{b}",
        })
    return rows


def countdown(
    split: str,
    size: int,
    seed: int,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 100,
    rule: str = "exactly_once",
    answer_tags: bool = True,
    prompt_template: str = COUNTDOWN_COMPACT_TEMPLATE,
    test_fraction: float = 0.2,
) -> list[dict]:
    """``size`` distinct Countdown puzzles, each solvable by construction.

    A puzzle draws ``min_numbers..max_numbers`` integers from ``1..max_number``
    and combines them all in a random order with random ``+ - * /`` into one
    expression whose every intermediate result is a non-negative integer;
    its value, if within ``[min_target, max_target]``, is the target. The
    expression is kept as ``extras["expression"]`` and the response an SFT
    stage should teach (``<answer>(3+5)*2</answer>``) as ``extras["solution"]``;
    it uses every number once and so solves the puzzle under either rule. ``rule`` is stored in
    ``extras["rule"]`` for the ``countdown`` reward: ``"exactly_once"``
    (TinyZero's Countdown; the default) or ``"at_most_once"``.

    Args:
        split: ``"train"`` or ``"test"`` (held out, also ``"heldout"`` ...).
        size: number of rows.
        seed: which puzzles are drawn and in which order.
        min_numbers, max_numbers: how many numbers a puzzle gives.
        max_number: largest given number.
        min_target, max_target: range of targets.
        rule: the number rule the reward applies.
        answer_tags: the solution is ``<answer>expr</answer>`` (else ``expr``).
        prompt_template: format string with ``{numbers}`` (``"3 5 2"``),
            ``{numbers_list}`` (``"[3, 5, 2]"``), ``{target}`` and
            ``{rule_text}``; see :data:`COUNTDOWN_INSTRUCT_TEMPLATE`.
        test_fraction: share of all puzzles held out for ``"test"``.
    """
    split = _check_common("countdown", split, size, test_fraction)
    if rule not in COUNTDOWN_RULES:
        raise ValueError(f"countdown: rule='{rule}' is not valid. Valid: {', '.join(COUNTDOWN_RULES)}")
    if not (isinstance(min_numbers, int) and isinstance(max_numbers, int) and 2 <= min_numbers <= max_numbers <= 8):
        raise ValueError(
            f"countdown: need 2 <= min_numbers <= max_numbers <= 8, got {min_numbers}, {max_numbers}"
        )
    if not (isinstance(max_number, int) and max_number >= 2):
        raise ValueError(f"countdown: max_number must be an integer >= 2, got {max_number!r}")
    if not (isinstance(min_target, int) and isinstance(max_target, int) and min_target <= max_target):
        raise ValueError(f"countdown: need min_target <= max_target, got {min_target}, {max_target}")
    template_key = "data.task_args.prompt_template"
    unknown = set(template_fields(prompt_template, template_key)) - set(COUNTDOWN_TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(
            f"countdown: {template_key}={prompt_template!r} is not a valid template: it uses "
            f"{', '.join(sorted(unknown))}, which a Countdown prompt does not have; fields: "
            + ", ".join("{" + f + "}" for f in COUNTDOWN_TEMPLATE_FIELDS)
        )

    rng = random.Random(f"countdown|{split}|{seed}")
    want_test = split == "test"
    rows, seen = [], set()
    for _ in range(200 * size + 10_000):
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
        target, expression = _random_expression(numbers, rng)
        if target is None or not (min_target <= target <= max_target):
            continue
        key = f"{sorted(numbers)}->{target}"
        if key in seen or is_held_out(key, test_fraction) != want_test:
            continue
        seen.add(key)
        rows.append({
            "prompt": fill_template(prompt_template, {
                "numbers": " ".join(map(str, numbers)),
                "numbers_list": "[" + ", ".join(map(str, numbers)) + "]",
                "target": target,
                "rule_text": _RULE_TEXT[rule],
            }, template_key),
            "ground_truth": str(target),
            "extras": {
                "task": "countdown", "numbers": numbers, "target": target, "rule": rule,
                "expression": expression,
                "solution": f"<answer>{expression}</answer>" if answer_tags else expression,
            },
            "id": f"countdown/{' '.join(map(str, sorted(numbers)))}->{target}",
        })
        if len(rows) == size:
            return rows
    raise ValueError(
        f"countdown: could not draw {size} distinct '{split}' puzzles with numbers 1..{max_number} and "
        f"targets {min_target}..{max_target}; lower size or widen the ranges"
    )


# Operator precedence, for printing an expression with only the parentheses it needs.
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[int | None, str]:
    """Combine all ``numbers`` with random operators; ``(value, expression)`` or ``(None, "")``."""
    pool = [(n, str(n), _ATOM) for n in numbers]
    while len(pool) > 1:
        rng.shuffle(pool)
        (a, a_text, a_prec), (b, b_text, b_prec) = pool.pop(), pool.pop()
        choices = ["+", "*"]
        if a >= b:
            choices.append("-")
        if b != 0 and a % b == 0 and b != 1:
            choices.append("/")
        op = rng.choice(choices)
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
        prec = _PRECEDENCE[op]
        left = a_text if a_prec >= prec else f"({a_text})"
        # a-(b-c) and a/(b*c) need their parentheses; a+(b+c) does not.
        right_needs = b_prec < prec or (b_prec == prec and op in "-/")
        right = f"({b_text})" if right_needs else b_text
        pool.append((value, f"{left}{op}{right}", prec))
    value, text, _ = pool[0]
    return (value, text) if value >= 0 else (None, "")


#: The arguments every task function takes positionally (the kind ``task`` fills them in).
TASK_PROVIDED_ARGS = ("split", "size", "seed")


def task_arguments(fn: Callable[..., list[dict]]) -> tuple[list[str], bool]:
    """The ``data.task_args`` a task function accepts, and whether it takes any (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.name not in TASK_PROVIDED_ARGS
             and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def get_task(name: str) -> Callable[..., list[dict]]:
    """The task function registered as ``name`` (kind ``task``, see ``rltk_tasks``).

    An unknown name is a ``ValueError`` naming ``data.task``, the closest
    registered names and all of them.
    """
    from rltk.registry import RegistryError, get_registry

    try:
        return get_registry().entry("task", name, where="data.task").obj
    except RegistryError as exc:
        raise ValueError(str(exc)) from None


def make_task(name: str, split: str, size: int, seed: int, **args) -> list[dict]:
    """Rows of the synthetic task registered as ``name`` (``arithmetic``, ``countdown``, ...).

    Tasks come from the registry (hook ``rltk_tasks``), so a plugin's task
    is chosen by ``data.task`` like a builtin. ``args`` are the task's keyword
    arguments (see :func:`arithmetic`, :func:`countdown`); unknown ones are an
    error listing the valid ones.
    """
    fn = get_task(name)
    valid, takes_any = task_arguments(fn)
    unknown = sorted(set(args) - set(valid))
    if unknown and not takes_any:
        raise ValueError(f"synthetic task '{name}' has no argument(s) {unknown}. Valid: {', '.join(valid)}")
    return [_split_demonstration(row, name, index) for index, row in enumerate(fn(split, size, seed, **args))]


def _split_demonstration(row: dict, task: str, index: int) -> dict:
    """A task row whose ``messages`` end with an assistant turn, as a data file's ``messages`` column is read:
    one name for demonstrations everywhere. The messages before the first assistant turn become the
    episode's opening (``messages``) and the whole transcript the warm-up's demonstration
    (``sft_messages``). A row that already has ``sft_messages``, or whose messages end otherwise, is
    returned as it is."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if row.get("sft_messages") or not isinstance(messages, list) or not messages \
            or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
        return row
    from rltk.data.loading import _chat_columns

    chat = _chat_columns(messages, f"task '{task}': row {index} (id {row.get('id', '?')!r}), 'messages'")
    return {"prompt": chat["messages"], **row, **chat}  # without a prompt, the opening is the prompt (as in files)


def sft_examples(rows: list[dict]) -> list[tuple[str, str] | list[dict]]:
    """What a supervised warm-up teaches for each row: a ``(prompt, completion)`` pair or a transcript.

    A row with ``sft_messages`` (the multi-turn tasks, chat datasets) gives
    that transcript, a list of chat messages whose assistant turns are the
    targets (:func:`rltk.data.chat.tokenize_transcript` tokenizes it with the
    loss on those turns only). Any other row gives ``(prompt, completion)``
    with a correct completion: ``extras["solution"]`` when the row has one
    (Countdown: ``<answer>(3+5)*2</answer>``), else the ground truth
    (arithmetic: ``42``). The tokenizer's eos is not included; the SFT stage
    appends it.
    """
    return [
        [dict(m) for m in row["sft_messages"]] if row.get("sft_messages")
        else (row["prompt"], str(row.get("extras", {}).get("solution", row["ground_truth"])))
        for row in rows
    ]


def _check_common(task: str, split: str, size: int, test_fraction: float) -> str:
    """Validate the common arguments; return the canonical split name."""
    if split in HELD_OUT_ALIASES:
        split = "test"
    if split not in SPLITS:
        raise ValueError(
            f"{task}: split='{split}' is not valid. Valid: train, test (held out; also "
            f"{', '.join(HELD_OUT_ALIASES)})"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{task}: size must be a positive integer, got {size!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"{task}: test_fraction must be strictly between 0 and 1, got {test_fraction!r}")
    return split
