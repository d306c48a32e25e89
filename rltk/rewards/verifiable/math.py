"""Answer-matching rewards: ``exact_match`` and ``math_answer``.

Both compare a model's final answer with the ground truth twice: as numbers
(exactly, with :class:`fractions.Fraction`, after removing thousands
separators, ``$``, ``%``, a trailing ``.0`` ...) and as normalised strings.
Model output is hostile input, so the work per call is bounded whatever the
response's length: markers are found with C-speed ``rfind``, and Python-level
parsing only ever looks at :data:`MAX_ANSWER_CHARS` characters; an answer
longer than that scores 0. Numbers longer than :data:`MAX_NUMBER_CHARS` are
refused (``parse_number("9" * 10**6)`` is ``None``, not an hour of big-integer
work), and numbers are compared exactly, so a 309-digit answer (beyond a
float) scores 0 or 1 instead of raising ``OverflowError``.

Digits are ASCII ``0-9`` only. Python's ``\\d``, ``int`` and ``Fraction``
accept every Unicode decimal digit (``"٤٢"``, fullwidth ``"４２"``, even a
mix such as ``"4٢"``), which would make a reward credit digits the task never
asked for and accept mixed-script look-alikes. Here such a text is not a
number: it is compared as a normalised string, so it matches a ground truth
written in the same characters and nothing else. A task whose answers use
other digits should convert them in its data or in a reward of its own.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rltk.rewards.marks import bounded

# Longest answer (extracted \boxed{} content, "####" line, exact_match's
# first line) the rewards parse; anything longer scores 0. It bounds the work
# per response: a 10 MB response costs a few C-speed scans and no more.
MAX_ANSWER_CHARS = 10_000
# Longest digit string parse_number turns into a number (Python refuses int()
# on more than 4300 digits by default, and no answer needs that many).
MAX_NUMBER_CHARS = 400
# 10**MAX_EXPONENT is the largest power a scientific-notation answer may ask for.
MAX_EXPONENT = 100

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?", re.ASCII)
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?", re.ASCII)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac(\d)(\d)", re.ASCII)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?", re.ASCII)
# The start of the run of number characters that ends a text (see extract_last_number).
_NUMBER_RUN_START = re.compile(r"[^0-9.,\-][0-9.,\-]*\Z")
_BOXED_TOKEN = re.compile(r"[^\s$]+")
_VARIABLE_PREFIX = re.compile(r"^[a-zA-Z]\s*=\s*")
_WHITESPACE = re.compile(r"\s+")


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or ``None`` if it is not one.

    Accepts integers and decimals with an optional sign, thousands separators
    (``1,234``, LaTeX ``1{,}234``), scientific notation up to ``1e100``,
    fractions ``3/4`` and ``\\frac{3}{4}``, and ignores ``$`` / ``\\$`` signs and a
    trailing ``%`` (so ``50%`` equals ``50``).

    >>> parse_number("1,234.50"), parse_number("\\\\frac{3}{4}"), parse_number("x")
    (Fraction(2469, 2), Fraction(3, 4), None)
    """
    s = text.strip()
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    s = (s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("{,}", ",")
         .replace("\\!", "").replace("\u2212", "-").strip())
    s = s.removesuffix("%")
    frac = _LATEX_FRAC.fullmatch(s) or _LATEX_FRAC_SHORT.fullmatch(s)
    if frac:
        return _ratio(frac.group(1), frac.group(2))
    if s[:1] in "+-" and s[1:2] == "\\":  # -\frac{1}{2}
        inner = parse_number(s[1:])
        return None if inner is None else (-inner if s[0] == "-" else inner)
    if s.count("/") == 1:
        num, den = s.split("/")
        return _ratio(num, den)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    match = _DECIMAL.fullmatch(s)
    if not match:
        return None
    if match.group(1) is not None and abs(int(match.group(1))) > MAX_EXPONENT:
        return None
    return Fraction(s)


def _ratio(numerator: str, denominator: str) -> Fraction | None:
    num, den = parse_number(numerator), parse_number(denominator)
    if num is None or den is None or den == 0:
        return None
    return num / den


def normalise_answer(text: str) -> str:
    """A canonical string form of an answer, for comparing non-numeric answers.

    Unwraps ``\\text{..}``, drops ``\\left``/``\\right``, LaTeX spacing, ``$``,
    degree marks, a leading ``x =`` and a trailing period; writes ``\\dfrac``
    and ``\\frac12`` as ``\\frac{1}{2}``; removes all whitespace.
    """
    s = text.strip()
    s = _LATEX_TEXT.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$",
                  "^{\\circ}", "^\\circ", "\\circ", "\\%"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LATEX_FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _VARIABLE_PREFIX.sub("", s)
    s = _WHITESPACE.sub("", s)
    return s.rstrip(".")


def answers_match(predicted: str, truth: str, *, rel_tol: float = 1e-9) -> bool:
    """Whether two answers agree, as numbers if both parse, else as normalised strings.

    Numbers agree when ``|p - t| <= rel_tol * max(|p|, |t|)``, computed in
    exact rational arithmetic: a float would overflow beyond ``1.8e308``.
    """
    pred_norm, truth_norm = normalise_answer(predicted), normalise_answer(truth)
    pred_num, truth_num = parse_number(pred_norm), parse_number(truth_norm)
    if pred_num is not None and truth_num is not None:
        if pred_num == truth_num:
            return True
        return abs(pred_num - truth_num) <= _tolerance(rel_tol) * max(abs(pred_num), abs(truth_num))
    return pred_norm == truth_norm and pred_norm != ""


def _tolerance(rel_tol: float) -> Fraction:
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, (int, float)) or not 0 <= rel_tol < float("inf"):
        raise ValueError(f"math_answer: rel_tol must be a finite number >= 0, got {rel_tol!r}")
    return Fraction(rel_tol)


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces are matched by counting, so ``\\boxed{\\frac{1}{2}}`` gives
    ``\\frac{1}{2}``; an unclosed last box gives ``None``. ``\\boxed 5`` (no
    braces) gives ``5``. Content longer than :data:`MAX_ANSWER_CHARS` gives
    ``None`` too, so the brace count never walks a whole hostile response.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = _BOXED_TOKEN.match(text, i, i + MAX_ANSWER_CHARS + 1)
        return token.group(0) if token and len(token.group(0)) <= MAX_ANSWER_CHARS else None
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_hash_answer(text: str) -> str | None:
    """What follows the last ``####`` on its line (GSM8K style), or ``None``.

    A closing tag ends the answer too: ``<answer>#### 7</answer>`` gives ``7``.
    An answer longer than :data:`MAX_ANSWER_CHARS` gives ``None``.
    """
    start = text.rfind("####")
    if start < 0:
        return None
    # Room for an answer, one more character and a "</" starting right after the answer: if the
    # line is not cut within it, the answer is too long.
    window = text[start + 4 : start + 4 + MAX_ANSWER_CHARS + 2]
    answer = window.split("\n", 1)[0].split("</", 1)[0]
    if len(answer) > MAX_ANSWER_CHARS:
        return None
    return answer.strip() or None


def extract_last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-12``, ``1,234.5``), or ``None``.

    Only the run of number characters (``0-9 . , -``) around the last digit
    is scanned, so the cost does not grow with ``text``; a run longer than
    :data:`MAX_ANSWER_CHARS` gives ``None``.
    """
    end = max(text.rfind(digit) for digit in "0123456789")
    if end < 0:
        return None
    window_start = max(0, end - MAX_ANSWER_CHARS)
    window = text[window_start : end + 1]
    # The run starts right after a character no number contains, so scanning it splits the
    # numbers exactly as a scan of the whole text would.
    boundary = _NUMBER_RUN_START.search(window)
    if boundary is not None:
        window = window[boundary.start() + 1 :]
    elif window_start > 0:
        return None
    last = None
    for last in _LAST_NUMBER.finditer(window):
        pass
    return last.group(0).rstrip(",") if last else None


def extract_final_answer(text: str, *, flexible: bool = False) -> str | None:
    """The final answer in ``text``: whichever of ``#### x`` and the last
    ``\\boxed{x}`` comes later; with ``flexible``, else the last number."""
    boxed_at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    hash_at = text.rfind("####")
    answer = None
    if boxed_at > hash_at:
        answer = extract_boxed(text)
    elif hash_at >= 0:
        answer = extract_hash_answer(text)
    if answer is None and flexible:
        answer = extract_last_number(text)
    return answer


@bounded
def math_answer(
    *,
    prompt: str,
    response: str,
    ground_truth: str,
    extras: dict,
    flexible: bool = False,
    format_score: float = 0.0,
    rel_tol: float = 1e-9,
) -> float:
    """1.0 when the response's final answer equals the ground truth, else 0.0.

    The answer is the text after the last ``####`` (GSM8K, Cobbe et al. 2021,
    arXiv:2110.14168) or inside the last ``\\boxed{...}`` (MATH, Hendrycks et
    al. 2021, arXiv:2103.03874), whichever comes later; with ``flexible=True``
    a response with neither is judged by its last number. The ground truth
    may be a bare answer (``"72"``) or a full solution ending in ``#### 72``
    or ``\\boxed{72}``. Answers are compared as exact numbers (``1,000`` =
    ``1000.0``, ``\\frac{1}{2}`` = ``0.5``, ``50%`` = ``50``) within relative
    tolerance ``rel_tol``, else as normalised strings (see
    :func:`normalise_answer`). Digits are ASCII only and answers longer than
    :data:`MAX_ANSWER_CHARS` score 0 (see the module docstring).

    Args:
        flexible: fall back to the last number when no marked answer exists.
        format_score: reward for a response with an answer that is wrong
            (0.0 by default; a small value rewards the format alone).
        rel_tol: relative tolerance of the numeric comparison.
    """
    truth = extract_final_answer(ground_truth) or ground_truth.strip()
    predicted = extract_final_answer(response, flexible=flexible)
    if predicted is None:
        return 0.0
    return 1.0 if answers_match(predicted, truth, rel_tol=rel_tol) else float(format_score)


@bounded
def exact_match(
    *,
    prompt: str,
    response: str,
    ground_truth: str,
    extras: dict,
    stop_strings: tuple[str, ...] | list[str] = ("\n",),
    case_sensitive: bool = False,
    numeric: bool = True,
) -> float:
    """1.0 when the response, up to its first stop string, equals the ground truth.

    The response is cut at the first of ``stop_strings`` (by default its
    first line; add e.g. ``"<|im_end|>"`` if responses are decoded with
    special tokens), stripped, with runs of whitespace collapsed; compared
    case-insensitively unless ``case_sensitive``. With ``numeric`` two
    strings that both parse as numbers are equal when the numbers are
    (``"42.0"`` = ``"42"``, ``"1,000"`` = ``"1000"``, see :func:`parse_number`;
    ASCII digits only). A first line longer than :data:`MAX_ANSWER_CHARS`
    scores 0.0.
    """
    # One character more than an answer may have, plus room for a stop string that starts within
    # it: if no stop string cuts the text, the first line is too long.
    text = response.lstrip()[: MAX_ANSWER_CHARS + 1 + max((len(stop) for stop in stop_strings), default=0)]
    for stop in stop_strings:
        if stop:
            text = text.split(stop, 1)[0]
    if len(text) > MAX_ANSWER_CHARS:
        return 0.0
    predicted = _WHITESPACE.sub(" ", text).strip()
    truth = _WHITESPACE.sub(" ", ground_truth).strip()
    if not predicted:
        return 0.0
    if numeric:
        pred_num, truth_num = parse_number(predicted), parse_number(truth)
        if pred_num is not None and truth_num is not None:
            return 1.0 if pred_num == truth_num else 0.0
    if not case_sensitive:
        predicted, truth = predicted.casefold(), truth.casefold()
    return 1.0 if predicted == truth else 0.0
