"""``reward_model``: a sequence-classification model scores prompt + response, locally or behind a URL.

The reward of an RLHF run in the InstructGPT / verl ``reward_model`` sense: a model with a
single-output head (``AutoModelForSequenceClassification``, ``num_labels=1``, e.g.
``Qwen2ForSequenceClassification``) reads the text ``prompt + response`` and its output at the
last real token is the raw reward ``r``. The score the trainer sees is

    score = scale * (sigmoid(r) if sigmoid else r) + offset

(``scale``/``offset`` normalise a model whose raw outputs sit far from the rule rewards it is
combined with, e.g. ``offset = -mean / std``, ``scale = 1 / std`` over a reference set; ``sigmoid``
maps a Bradley-Terry model's logit to the probability of being preferred). Each sample also
reports ``reward_model/raw`` (r), which the logs average per step.

Two ways to reach the model (exactly one of ``path`` and ``url``):

* ``path``: a local Hugging Face folder as ``save_pretrained`` writes it (``config.json`` with a
  ``*ForSequenceClassification`` architecture and ``num_labels: 1``, the weights, and the tokenizer
  files). This is what rltk's reward-model training (issue 32) writes. The model is loaded once
  per process and kept (:func:`load_scorer`), not per call; it scores in micro-batches of
  ``micro_batch_size`` texts, each cut to ``max_length`` tokens from the ``truncation_side``
  (``left`` by default: the end of the response, where the answer is, is kept).
* ``url``: a reward server (``rltk serve-reward PATH``, or ``python -m rltk.rewards.judges.reward_server
  PATH``, on another machine), spoken to with the small protocol of
  :mod:`rltk.rewards.judges.reward_server`: ``POST {"prompts": [...], "responses": [...]}`` ->
  ``{"scores": [raw, ...]}``. Truncation, micro-batching and the device are the server's then
  (its flags); here ``micro_batch_size`` texts go in each request, ``concurrency`` requests at
  once, each given at most ``timeout_s`` in all (connecting, sending, reading the whole answer),
  retried ``retries`` times with exponential backoff. A request that still fails gives its samples
  the composer's ``reward.fallback``, counted in ``reward_fn/failures/reward_model``, and stops the
  step's unsent requests (the server is down).

Config keys, mirroring verl's ``reward_model`` section where one exists (``model.path`` ->
``path``, ``micro_batch_size_per_gpu`` -> ``micro_batch_size``, ``max_length``)::

    reward:
      reward_fn: [exact_match, reward_model]
      weights: {exact_match: 1.0, reward_model: 0.5}
      reward_fn_args:
        reward_model: {path: runs/rm/model, micro_batch_size: 16, max_length: 1024, sigmoid: true}

The text is ``prompt + response`` as the workflow gives them (the prompt already rendered with the
policy's chat template), tokenized without special tokens, like the policy's own input: a reward
model trained on another template should be trained on, or served with, rltk's rendering.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rltk.rewards.judges.http import ServerError, call_all, post_json, with_retries
from rltk.rewards.marks import batched

TRUNCATION_SIDES = ("left", "right")
#: Seconds before a failed request to ``url`` is tried again (doubling each retry).
RETRY_BACKOFF_S = 0.5
DTYPES = ("float32", "bfloat16", "float16")
# Arguments that configure a local model; with `url` they belong to the server (`rltk serve-reward` flags).
LOCAL_ONLY = {"max_length": "--max-length", "truncation_side": "--truncation-side", "device": "--device",
              "dtype": "--dtype"}


class RewardModelScorer:
    """Raw rewards of a local sequence-classification model, in micro-batches.

    Args:
        path: a Hugging Face folder (config, weights, tokenizer) of a ``num_labels=1`` model.
        device: where the model runs (``cpu``, ``cuda``, ``cuda:1`` ...).
        dtype: ``float32`` (default), ``bfloat16`` or ``float16``; ``None`` for float32.
        max_length: the most tokens of one text the model reads; longer ones are cut.
        truncation_side: ``left`` keeps a long text's end (the response), ``right`` its start.
        micro_batch_size: texts per forward pass.
        config_key: named in errors about ``path`` (the config key the user set).

    Shape: :meth:`score` of B texts runs ceil(B / micro_batch_size) forwards of
    ``[micro_batch_size, longest text in it]`` tokens, right-padded; the reward of a text is the
    head's output at its last real token, so padding (and which texts share a batch) does not
    change it.
    """

    def __init__(self, path: str, *, device: str = "cpu", dtype: str | None = None, max_length: int = 1024,
                 truncation_side: str = "left", micro_batch_size: int = 16,
                 config_key: str = "reward.reward_fn_args.reward_model.path"):
        import torch
        from transformers import AutoModelForSequenceClassification

        from rltk.models.loading import load_tokenizer, quiet_model_io

        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"'{config_key}': '{path}' is not a Hugging Face model folder (no config.json); "
                             f"pass a folder written by save_pretrained (a reward model's config, weights and "
                             f"tokenizer)")
        self.path = str(folder)
        self.tokenizer = load_tokenizer(folder, config_key=config_key)
        with quiet_model_io():
            model = AutoModelForSequenceClassification.from_pretrained(
                str(folder), local_files_only=True, dtype=getattr(torch, dtype or "float32"))
        if model.config.num_labels != 1:
            raise ValueError(f"'{config_key}': the model in '{path}' has num_labels={model.config.num_labels}; "
                             f"a reward model has one output (num_labels=1), its score")
        self.model = model.to(device).eval()
        self.device = device
        self.max_length = max_length
        self.truncation_side = truncation_side
        self.micro_batch_size = micro_batch_size
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self._lock = threading.Lock()  # one forward at a time: a server's threads share the model

    def tokenize(self, prompts: Sequence[str], responses: Sequence[str]) -> list[list[int]]:
        """Token ids of each ``prompt + response``, cut to ``max_length`` from ``truncation_side``."""
        ids = self.tokenizer([p + r for p, r in zip(prompts, responses)], add_special_tokens=False)["input_ids"]
        if self.truncation_side == "left":
            return [list(x[-self.max_length:]) for x in ids]
        return [list(x[: self.max_length]) for x in ids]

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """The raw reward of each ``prompt + response``, in order."""
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        ids = self.tokenize(prompts, responses)
        out: list[float] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(ids), self.micro_batch_size):
                chunk = [x if x else [self.pad_id] for x in ids[start:start + self.micro_batch_size]]
                out.extend(self._forward(chunk))
        return out

    def _forward(self, chunk: list[list[int]]) -> list[float]:
        import torch

        lengths = torch.tensor([len(x) for x in chunk])
        width = int(lengths.max())
        input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, x in enumerate(chunk):
            input_ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        last = (lengths - 1).to(self.device)
        head = getattr(self.model, "score", None)
        if isinstance(head, torch.nn.Linear):
            # Pool at each text's last real token ourselves: the model's own pooling finds it by looking
            # for pad ids, which is wrong when the pad token also occurs in the text (Qwen pads with a
            # token a response may contain).
            hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, T, H]
            pooled = hidden[torch.arange(len(chunk), device=hidden.device), last]  # [B, H]
            logits = head(pooled)  # [B, 1]
        else:
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits  # [B, 1]
        return [float(v) for v in logits[:, 0].float().cpu()]


_SCORERS: dict[tuple, RewardModelScorer] = {}
_SCORERS_LOCK = threading.Lock()


def load_scorer(path: str, *, device: str = "cpu", dtype: str | None = None, max_length: int = 1024,
                truncation_side: str = "left", micro_batch_size: int = 16) -> RewardModelScorer:
    """The :class:`RewardModelScorer` for these settings, loaded on first use and kept for the process."""
    key = (str(Path(path).expanduser().resolve()), device, dtype, max_length, truncation_side, micro_batch_size)
    with _SCORERS_LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = _SCORERS[key] = RewardModelScorer(path, device=device, dtype=dtype, max_length=max_length,
                                                       truncation_side=truncation_side,
                                                       micro_batch_size=micro_batch_size)
        return scorer


def check_reward_model_args(args: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the argument when ``reward_model``'s args do not go together."""
    path, url = args.get("path"), args.get("url")
    if (path is None) == (url is None):
        got = "both" if path is not None else "neither"
        raise ValueError(f"set exactly one of path (a local reward-model folder, save_pretrained format) or url "
                         f"(a reward server, e.g. http://host:8001/score from `rltk serve-reward PATH`); got {got}")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a folder path, got {path!r}")
        if not (Path(path).expanduser() / "config.json").is_file():
            raise ValueError(f"path '{path}' is not a Hugging Face model folder (no config.json); give the folder "
                             f"a reward model was saved to with save_pretrained (config, weights, tokenizer)")
    if url is not None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        given = [k for k in LOCAL_ONLY if args.get(k) is not None]
        if given:
            flags = ", ".join(f"{k} -> {LOCAL_ONLY[k]}" for k in given)
            raise ValueError(f"{', '.join(given)} configure a local model; with url they are the server's "
                             f"settings (rltk serve-reward flags: {flags})")
    side = args.get("truncation_side")
    if side is not None and side not in TRUNCATION_SIDES:
        raise ValueError(f"truncation_side must be one of {', '.join(TRUNCATION_SIDES)}, got {side!r}")
    dtype = args.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for key in ("micro_batch_size", "max_length", "retries", "concurrency"):
        value = args.get(key)
        low = 0 if key == "retries" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
    if args.get("sigmoid") is not None and not isinstance(args["sigmoid"], bool):
        raise ValueError(f"sigmoid must be true or false, got {args['sigmoid']!r}")
    for key in ("scale", "offset", "timeout_s"):
        value = args.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or (key == "timeout_s" and value <= 0)):
            valid = "a number of seconds > 0" if key == "timeout_s" else "a finite number"
            raise ValueError(f"{key} must be {valid}, got {value!r}")


@batched
def reward_model(
    *,
    prompt: list[str],
    response: list[str],
    path: str | None = None,
    url: str | None = None,
    micro_batch_size: int = 16,
    max_length: int | None = None,
    truncation_side: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    sigmoid: bool = False,
    scale: float = 1.0,
    offset: float = 0.0,
    timeout_s: float = 30.0,
    retries: int = 2,
    concurrency: int = 4,
) -> list[dict[str, float] | BaseException]:
    """A sequence-classification reward model's score of prompt + response, from a local folder or a server URL.

    See the module docs for the formula, the two forms and the server protocol.

    Batched (:func:`rltk.rewards.batched`): one call per step with every sample. Returns
    ``{"score": scale * f(r) + offset, "raw": r}`` per sample, ``f`` the sigmoid or the identity;
    a sample a server could not score is returned as the error, which the composer counts and
    gives the fallback score.

    Args:
        path: local model folder (``save_pretrained`` format, tokenizer included); or
        url: a reward server's scoring route (``rltk serve-reward``). Exactly one of the two.
        micro_batch_size: texts per forward pass (local) or per request (url).
        max_length, truncation_side, device, dtype: the local model's token budget per text
            (default 1024), the side cut from a longer one (``left``, default: keep the end),
            device (``cpu``) and dtype (``float32``); a server has its own.
        sigmoid, scale, offset: ``score = scale * (sigmoid(r) if sigmoid else r) + offset``.
        timeout_s, retries, concurrency: per request to ``url``, ``timeout_s`` the most it may take in all
            (connecting, sending, reading the whole answer: a trickling server times out too); retried
            with exponential backoff (0.5 s, 1 s ...); ``concurrency`` requests at once. Once one has
            spent its tries on a timeout or a refused connection, the rest of the step's are not sent
            (counted failures).
    """
    if url is None:
        scorer = load_scorer(path, device=device or "cpu", dtype=dtype, max_length=max_length or 1024,
                             truncation_side=truncation_side or "left", micro_batch_size=micro_batch_size)
        raws: list[float | BaseException] = list(scorer.score(prompt, response))
    else:
        starts = range(0, len(prompt), micro_batch_size)
        chunks = call_all([functools.partial(_score_remote, url, list(prompt[i:i + micro_batch_size]),
                                             list(response[i:i + micro_batch_size]), timeout_s=timeout_s,
                                             retries=retries) for i in starts], concurrency=concurrency)
        raws = []
        for start, chunk in zip(starts, chunks):
            n = len(prompt[start:start + micro_batch_size])
            raws.extend([chunk] * n if isinstance(chunk, BaseException) else chunk)
    out: list[dict[str, float] | BaseException] = []
    for raw in raws:
        if isinstance(raw, BaseException):
            out.append(raw)
            continue
        value = 1.0 / (1.0 + math.exp(-raw)) if sigmoid else raw
        out.append({"score": scale * value + offset, "raw": raw})
    return out


reward_model.check_args = check_reward_model_args  # type: ignore[attr-defined]


def _score_remote(url: str, prompts: list[str], responses: list[str], *, timeout_s: float,
                  retries: int) -> list[float]:
    answer = with_retries(
        lambda: post_json(url, {"prompts": prompts, "responses": responses}, timeout_s=timeout_s),
        retries=retries, backoff_s=RETRY_BACKOFF_S, retry_on=(TimeoutError, ConnectionError, ServerError))
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if (not isinstance(scores, list) or len(scores) != len(prompts)
            or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)):
        raise ValueError(f"{url} answered {str(answer)[:200]}; expected {{\"scores\": [{len(prompts)} finite numbers]}}")
    return [float(s) for s in scores]
