"""``llm_judge``: an LLM behind any OpenAI-compatible endpoint grades each response with a rubric.

For each sample the ``template`` is filled with ``{prompt}``, ``{response}`` and ``{ground_truth}``
(literal braces doubled, as in ``str.format``), sent as the user message of a chat completion
(after ``system``, if given) to ``{url}/chat/completions`` with ``model``, ``temperature`` (0:
greedy, so the same response gets the same verdict) and ``max_tokens``, and the reply's text
is parsed into a score:

* ``parser: number`` (default): the *last* match of ``pattern`` (default ``Score: <number>``,
  case-insensitive) is the verdict ``v``; the score is ``v / max_score`` (default 10), so a
  0-10 rubric gives rewards in [0, 1]. The last match, since judges reason before they conclude.
* ``parser: yes_no``: the last match of ``pattern`` (default a whole word ``yes`` or ``no``)
  gives 1.0 for yes and 0.0 for no.

The endpoint may be another ``rltk serve``, a vLLM or SGLang server, or a hosted API
(``api_key``). Requests run ``concurrency`` at a time; each waits at most ``timeout_s`` for the
server's whole answer (a deadline on connecting, sending and reading it all, so a server trickling
it byte by byte times out too) and is tried ``retries`` more times on a timeout, a refused or
broken connection, or an HTTP 5xx/429, after ``backoff_s``, then twice that ... Once one request
has spent its tries on a timeout or a connection error, the step's requests not yet sent are not
sent (the judge is down or hangs), so such a step waits about ``(retries + 1) * timeout_s`` plus
the backoff, whatever its number of samples. A sample whose judge call fails, or whose verdict
does not parse, gets the composer's ``reward.fallback`` and is counted: in
``reward_fn/failures/llm_judge`` (every fallback) and ``reward_fn/timeouts/llm_judge`` (the
requests that timed out), with one warning naming the first reason.

Example::

    reward:
      reward_fn: [exact_match, llm_judge]
      weights: {exact_match: 1.0, llm_judge: 0.5}
      reward_fn_args:
        llm_judge:
          url: http://judge-host:8000/v1
          model: Qwen/Qwen2.5-7B-Instruct
          template: "Question: {prompt}\\nReference: {ground_truth}\\nAnswer: {response}\\nIs the answer
                     correct? Reply yes or no."
          parser: yes_no
"""

from __future__ import annotations

import math
import re
import string
import functools
from typing import Any

from rltk.rewards.judges.http import ServerError, call_all, post_json, with_retries
from rltk.rewards.marks import batched

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth")
PARSERS = {
    "number": r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)",
    "yes_no": r"(?i)\b(yes|no)\b",
}
DEFAULT_TEMPLATE = (
    "You are grading an answer to a task.\n\nTask:\n{prompt}\n\nReference answer:\n{ground_truth}\n\n"
    "Answer to grade:\n{response}\n\nGrade the answer from 0 (wrong or unhelpful) to 10 (correct and complete). "
    "Explain briefly, then end with a line 'Score: N'."
)


class UnparsedVerdict(ValueError):
    """The judge answered, but its text holds no verdict the parser recognises."""


def check_llm_judge_args(args: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the argument when ``llm_judge``'s args are not valid."""
    url = args.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url must be the judge's OpenAI-compatible base URL, starting with http:// or https:// "
                         f"(e.g. http://host:8000/v1), got {url!r}")
    if not isinstance(args.get("model"), str) or not args.get("model"):
        raise ValueError(f"model must name the judge model the endpoint serves, got {args.get('model')!r}")
    template = args.get("template", DEFAULT_TEMPLATE)
    if not isinstance(template, str):
        raise ValueError(f"template must be a string, got {template!r}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"template is not a valid format string ({exc}); write literal braces as {{{{ and }}}}") \
            from None
    bad = sorted({f for f in fields if f not in TEMPLATE_FIELDS})
    if bad:
        raise ValueError(f"template has field(s) {['{' + f + '}' for f in bad]}; valid fields: "
                         f"{', '.join('{' + f + '}' for f in TEMPLATE_FIELDS)} (write literal braces as {{{{ }}}})")
    if "response" not in fields:
        raise ValueError("template never shows the judge the {response} it grades")
    parser = args.get("parser", "number")
    if parser not in PARSERS:
        raise ValueError(f"parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    pattern = args.get("pattern")
    if pattern is not None:
        try:
            groups = re.compile(pattern).groups
        except (re.error, TypeError) as exc:
            raise ValueError(f"pattern {pattern!r} is not a regular expression: {exc}") from None
        if groups < 1:
            raise ValueError(f"pattern {pattern!r} needs a capturing group around the verdict, e.g. "
                             f"{PARSERS[parser]!r}")
    for key, low, integer in (("max_score", 0, False), ("timeout_s", 0, False), ("backoff_s", -1, False),
                              ("retries", -1, True), ("concurrency", 0, True), ("max_tokens", 0, True),
                              ("temperature", -1, False)):
        if key not in args:
            continue
        value = args[key]
        kind = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= low:
            what = "an integer" if integer else "a number"
            raise ValueError(f"{key} must be {what} {'>= 0' if low == -1 else '> 0'}, got {value!r}")


def parse_verdict(text: str, parser: str = "number", pattern: str | None = None, max_score: float = 10.0) -> float:
    """The score in a judge's ``text`` (see the module docs); :class:`UnparsedVerdict` if there is none."""
    matches = list(re.finditer(pattern or PARSERS[parser], text))
    if not matches:
        raise UnparsedVerdict(f"no verdict matching {pattern or PARSERS[parser]!r} in the judge's reply "
                              f"{text[-200:]!r}")
    verdict = matches[-1].group(1)
    if parser == "yes_no":
        word = verdict.strip().lower()
        if word not in ("yes", "no"):
            raise UnparsedVerdict(f"the judge's verdict {verdict!r} is neither yes nor no")
        return 1.0 if word == "yes" else 0.0
    try:
        value = float(verdict)
    except ValueError:
        raise UnparsedVerdict(f"the judge's verdict {verdict!r} is not a number") from None
    if not math.isfinite(value):
        raise UnparsedVerdict(f"the judge's verdict {verdict!r} is not a finite number")
    return value / max_score


@batched
def llm_judge(
    *,
    prompt: list[str],
    response: list[str],
    ground_truth: list[str],
    url: str,
    model: str,
    template: str = DEFAULT_TEMPLATE,
    system: str | None = None,
    parser: str = "number",
    pattern: str | None = None,
    max_score: float = 10.0,
    temperature: float = 0.0,
    max_tokens: int = 256,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
    concurrency: int = 8,
    api_key: str | None = None,
) -> list[float | BaseException]:
    """An LLM at an OpenAI-compatible URL grades each response by a rubric; its parsed verdict is the score.

    Batched: one call per step (see the module docs for the protocol, parsers and failure counts).

    Returns the parsed score per sample, or the error (a ``TimeoutError``, ``ConnectionError``,
    ``ValueError`` or :class:`UnparsedVerdict`) for one the composer must give its fallback and count.
    """
    endpoint = url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    messages_head = [{"role": "system", "content": system}] if system else []

    def judge(i: int) -> float:
        text = template.format(prompt=prompt[i], response=response[i], ground_truth=ground_truth[i])
        body = {"model": model, "messages": messages_head + [{"role": "user", "content": text}],
                "temperature": temperature, "max_tokens": max_tokens}
        answer = with_retries(lambda: post_json(endpoint, body, timeout_s=timeout_s, headers=headers),
                              retries=retries, backoff_s=backoff_s, retry_on=(TimeoutError, ConnectionError, ServerError))
        try:
            reply = answer["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"{endpoint} answered {str(answer)[:200]}, not a chat completion") from None
        return parse_verdict(reply, parser, pattern, max_score)

    return call_all([functools.partial(judge, i) for i in range(len(prompt))], concurrency=concurrency)


llm_judge.check_args = check_llm_judge_args  # type: ignore[attr-defined]
