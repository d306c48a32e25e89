"""Rollout traces: a bounded sample of each RL step's trajectories in ``<run_dir>/traces.jsonl``.

Curves say *that* the reward moved; the samples say *why* (the policy found
the format, learned to carry, started gaming a judge). rltk keeps, for every
``logging.traces_every``-th RL step, ``logging.traces_per_step`` trajectories
of the batch the step trained on, taken as whole groups (the advantages of a
group only mean something next to each other), one JSON object per line::

    {"step": 1205, "stage": "grpo", "stage_step": 5, "row": 0, "group_id": 3, "sample_index": 0,
     "row_id": "train-17", "prompt": "12+30=", "response": "42", "ground_truth": "42",
     "score": 1.0, "rewards": {"exact_match": 1.0}, "advantage": 0.94, "finish_reason": "stop",
     "source": "policy", "staleness": 0, "response_tokens": 3, "policy_tokens": 3,
     "tokens": ["4", "2", "<eos>"], "token_ids": [...], "response_mask": [1, 1, 1],
     "advantages": [0.94, 0.94, 0.94], "logprobs": [-0.1, -0.3, -0.01], "token_rewards": [0, 0, 1.0],
     "info": {...}, "images": [{"type": "image", "width": 56, "height": 56, "thumbnail": "data:image/png;base64,..."}]}

``images`` holds a thumbnail of each of the prompt's images (``data.image_key``), in the prompt's order:
a PNG of at most 64 pixels a side and 8 KiB (:func:`rltk.data.images.thumbnail`), made once per row and
kept for the run, enough to tell which picture a sample answered without copying the dataset into the
file. An image anywhere in ``info`` (an environment's or a tool's observation in ``messages``, as
``{"type": "image", "image": ...}`` content parts) is written as the same thumbnail part.

``info`` is the workflow's own record of the episode, whatever it holds:
multi-turn episodes keep their ``messages`` (assistant turns, tool calls and
tool/environment observations), turn and tool counters and environment
rewards; the agentic workflow its session and segment. Per-token lists are
over the response part (assistant and observation tokens); ``response_mask``
is 0 on observation tokens, so its runs of 1s and 0s are the turns.

The file never grows past ``logging.traces_max_mb``: the step that would
cross it is not written, and no later one (the run prints that once). On
resume, lines after the checkpoint's step are dropped first, as
``metrics.jsonl`` does. Only the main process writes, from its own share of
the batch. Nothing here is ever executed by a reader: the viewer
(``rltk dashboard``) parses it as JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from rltk.buffer.buffer import POLICY, staleness, trainer_version
from rltk.data.images import is_image, thumbnail
from rltk.loggers.jsonl import TRACES_FILE, read_jsonl_metrics

#: ``info`` keys already written at the top level of a record.
_TOP_LEVEL_INFO = ("prompt", "response", "ground_truth", "row_id", "sample_index")


def _number(value: float, digits: int = 5) -> float | None:
    """A float rounded for a compact file; NaN/inf as None (strict JSON)."""
    value = float(value)
    return round(value, digits) if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON: tensors and numpy scalars as numbers/lists, anything unknown as its ``str``."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, (int,)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if is_image(value):
        return thumbnail(value)
    if isinstance(value, dict):
        if value.get("type") == "image" and is_image(value.get("image")):  # a chat content part: the part itself
            return {**{str(k): _jsonable(v) for k, v in value.items() if k != "image"}, **thumbnail(value["image"])}
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError):
            pass
    return str(value)


def pick_rows(group_ids: Sequence[int], limit: int) -> list[int]:
    """Batch rows to trace: whole groups in order of first appearance, at most ``limit`` rows.

    A group larger than what is left of ``limit`` is cut to fit only when it
    is the first one (so a step with ``rollout.n`` above the limit still shows
    something); otherwise it is left out whole.
    """
    order: dict[int, list[int]] = {}
    for row, gid in enumerate(group_ids):
        order.setdefault(int(gid), []).append(row)
    rows: list[int] = []
    for members in order.values():
        if len(rows) + len(members) <= limit:
            rows.extend(members)
        elif not rows:
            rows.extend(members[:limit])
        if len(rows) >= limit:
            break
    return rows


class TraceWriter:
    """Writes the sampled trajectories of RL steps to ``run_dir/traces.jsonl`` (see the module docstring).

    Args:
        run_dir: the run folder.
        tokenizer: decodes each response token on its own, for the per-token view.
        per_step: trajectories kept per traced step (``logging.traces_per_step``).
        every: trace every ``every``-th stage step (``logging.traces_every``).
        max_mb: the file's size cap in MiB (``logging.traces_max_mb``).
        resume_step: the global step a resumed run continues from (0 for a new run): later lines go.
        row_images: the images of the rows that have some, by row id (``row["images"]``), for the records'
            ``images`` thumbnails.
    """

    def __init__(self, run_dir: str | Path, tokenizer, *, per_step: int = 16, every: int = 1,
                 max_mb: float = 100.0, resume_step: int | None = None,
                 row_images: dict[str, list] | None = None):
        self.path = Path(run_dir) / TRACES_FILE
        self.tokenizer = tokenizer
        self.per_step, self.every = int(per_step), int(every)
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.full = False
        if resume_step is not None:
            _drop_after(self.path, resume_step)
        self.size = self.path.stat().st_size if self.path.exists() else 0
        self.row_images = dict(row_images or {})
        self._thumbnails: dict[str, list[dict]] = {}  # by row id: a row is traced again in later epochs

    def thumbnails(self, row_id: Any) -> list[dict]:
        """The thumbnails of row ``row_id``'s images (``[]`` for a row without any)."""
        key = str(row_id)
        if key not in self._thumbnails:
            self._thumbnails[key] = [thumbnail(image) for image in self.row_images.get(key, ())]
        return self._thumbnails[key]

    def _pieces(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own; one batched call where the tokenizer has it (a real model's responses
        run to thousands of tokens, and one decode call per token would cost a second a step)."""
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        if callable(batch_decode):
            return list(batch_decode([[t] for t in ids]))
        return [self.tokenizer.decode([t]) for t in ids]

    def records(self, stage, step: int, batch: dict[str, torch.Tensor], items: Sequence | None) -> list[dict]:
        """The trace records of stage step ``step`` (the rows :func:`pick_rows` keeps)."""
        rows = pick_rows(batch["group_ids"].tolist(), self.per_step)
        lengths = batch["response_lengths"].tolist()
        width = batch["response_mask"].shape[1]
        P = batch["input_ids"].shape[1] - width
        global_step = stage.first_step + step
        stage_name = str(stage.run.cfg.stages[stage.index].name)
        out = []
        for row in rows:
            n = int(lengths[row])
            ids = batch["input_ids"][row, P:P + n].tolist()
            mask = batch["response_mask"][row, :n]
            adv = batch["advantages"][row, :n] if "advantages" in batch else None
            item = items[row] if items is not None and row < len(items) else None
            experience = getattr(item, "experience", None)
            info = dict(getattr(experience, "info", None) or {})
            policy_tokens = float(mask.sum())
            record = {
                "step": global_step, "stage": stage_name, "stage_step": step, "row": row,
                "group_id": int(batch["group_ids"][row]),
                "sample_index": info.get("sample_index"), "row_id": info.get("row_id"),
                "prompt": info.get("prompt", ""), "response": info.get("response", ""),
                "ground_truth": info.get("ground_truth", ""),
                "score": _number(batch["scores"][row]),
                "rewards": _jsonable(getattr(experience, "reward_details", {}) or {}),
                # the advantage of the sequence: the mean over the policy's tokens (outcome estimators
                # give every token the same one; per-token estimators such as GAE vary, see "advantages")
                "advantage": _number((adv * mask).sum() / policy_tokens) if adv is not None and policy_tokens
                else None,
                "finish_reason": getattr(experience, "finish_reason", None),
                "source": getattr(item, "source", None),
                # policy versions between the one that sampled it and the one it trains (0 on-policy; the
                # queue's staleness/* in an asynchronous run); none for expert data
                "staleness": staleness(trainer_version(step), item.sampled_version)
                if item is not None and item.source == POLICY else None,
                "response_tokens": n, "policy_tokens": int(policy_tokens),
                "tokens": self._pieces(ids),
                "token_ids": ids,
                "response_mask": [int(m) for m in mask.tolist()],
                "advantages": [_number(a, 4) for a in adv.tolist()] if adv is not None else None,
                "logprobs": [_number(x, 4) for x in batch["rollout_logprobs"][row, :n].tolist()]
                if bool(batch["has_rollout_logprobs"][row]) else None,
                "token_rewards": [_number(x, 4) for x in batch["token_rewards"][row, :n].tolist()],
                # a critic's value estimates (ppo), beside the advantages computed from them
                "values": [_number(x, 4) for x in batch["values"][row, :n].tolist()] if "values" in batch else None,
                "info": _jsonable({k: v for k, v in info.items() if k not in _TOP_LEVEL_INFO}),
                "images": self.thumbnails(info.get("row_id")) if self.row_images else [],
            }
            out.append(record)
        return out

    def write(self, stage, step: int, batch: dict[str, torch.Tensor], items: Sequence | None) -> int:
        """Append the traces of stage step ``step`` if it is a traced step and the cap allows; returns lines written."""
        if self.full or self.every <= 0 or step % self.every:
            return 0
        text = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n"
                       for r in self.records(stage, step, batch, items))
        size = len(text.encode("utf-8"))
        if self.size + size > self.max_bytes:
            self.full = True
            print(f"rltk: {self.path} reached logging.traces_max_mb={self.max_bytes / 2**20:g}; no more traces are "
                  f"written this run (raise it, or trace fewer steps with logging.traces_every)")
            return 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
        self.size += size
        return text.count("\n")


def _drop_after(path: Path, step: int) -> None:
    """Remove lines whose step is greater than ``step`` (and malformed lines), through a rename."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)) and record["step"] <= step:
            kept.append(line)
    temp = path.with_name(path.name + ".tmp")
    temp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(temp, path)


def read_traces(path: str | Path, *, step: int | None = None) -> list[dict]:
    """The records of a traces file (of one global ``step`` if given); blank or cut lines are skipped."""
    path = Path(path)
    if not path.exists():
        return []
    return [r for r in read_jsonl_metrics(path) if step is None or r.get("step") == step]
