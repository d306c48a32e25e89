"""The divergence guard: stop a run that has stopped learning, and say why, when and where to go back to.

A learning rate far too high, a loss that overflows, or an update that blows
up the weights leaves a run that keeps going and exits 0 having learnt
nothing: with ``trainer.lr=1e3`` the tiny default's policy is the uniform
distribution after one RL step, and a run whose every optimizer step is
skipped (non-finite gradient norm) trains nothing at all. The guard watches
each stage's logged metrics and stops the run with :class:`TrainingDiverged`
(``rltk run`` prints it and exits with status 3) on four symptoms:

* **nothing trained**: ``guard.max_skipped_steps`` steps in a row in which
  every optimizer step was skipped (``skipped`` = 1: the strategy found the
  gradient norm non-finite) or a loss was non-finite; also a stage that ends
  without one update applied, however short.
* **collapse to uniform**: mean token entropy above ``guard.entropy_max`` x
  log(V) for ``guard.entropy_patience`` steps in a row, V being the size of
  the LM head. A randomly initialised model starts there, so this counts
  only once the stage has seen the entropy below that line: collapse is a
  move back to uniform, not never having left it.
* **collapse to one token**: mean token entropy below ``guard.entropy_min``
  x log(V) for ``guard.entropy_patience`` steps in a row.
* **non-finite weights**: any parameter of the policy (or the critic) holding
  nan or inf, checked every ``guard.check_weights_every`` steps and before
  every checkpoint, so no checkpoint is ever written with such weights.

The checks read metrics the step computed anyway (``entropy`` and
``sft/entropy`` come out of the fused log-prob kernel beside the log-probs;
``skipped`` and the losses from the update), so they cost no forward pass.
The weights check reads every parameter once (``isfinite`` on this rank's
shard), about the cost of an optimizer step's memory traffic without its
arithmetic: hence every K steps rather than every step. With several
processes every verdict is agreed by one all-reduce, so all ranks stop at
the same step.

The message names the symptom, the run's global step and the newest
checkpoint written before the symptom began (or says there is none). The
entropy a step reports is that of the weights the previous step left, so a
checkpoint counts as good only if it is older than the step before the first
bad one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

#: Exit status of ``rltk run`` when the guard stops a run: distinct from 1 (a crash) and 2 (a config error).
EXIT_DIVERGED = 3

#: Logged metrics the guard reads, by what they are. ``skipped`` is the fraction of a step's optimizer
#: steps that were skipped; the losses are means over the step's optimizer steps.
SKIPPED_KEYS = {"sft/skipped": "policy", "skipped": "policy", "critic/skipped": "critic"}
LOSS_KEYS = ("sft/sft_loss", "pg_loss", "kl_loss", "critic/vf_loss", "dpo_loss")
ENTROPY_KEYS = ("sft/entropy", "entropy")


class TrainingDiverged(RuntimeError):
    """The guard stopped the run; ``str()`` is the full message for the person reading the log.

    Attributes: ``symptom`` (``nothing_trained``, ``entropy_uniform``,
    ``entropy_zero``, ``nonfinite_weights``), ``step`` (global step) and
    ``checkpoint`` (the last good checkpoint's path, or None).
    """

    def __init__(self, message: str, *, symptom: str, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.symptom = symptom
        self.step = step
        self.checkpoint = checkpoint


@dataclass(frozen=True)
class GuardSettings:
    """The ``guard`` config section (see :class:`rltk.config.schema.GuardConfig` for each key)."""

    enabled: bool = True
    max_skipped_steps: int = 10
    entropy_min: float = 1.0e-4
    entropy_max: float = 0.999
    entropy_patience: int = 5
    check_weights_every: int = 10

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "GuardSettings":
        """Settings of a stage's config (its overrides applied); defaults where it has no ``guard`` section."""
        section = OmegaConf.select(cfg, "guard")
        return cls(**OmegaConf.to_container(section, resolve=True)) if section is not None else cls()


def vocab_size_of(model: torch.nn.Module) -> int:
    """The number of rows of ``model``'s LM head: the support of the distribution whose entropy is logged.

    Models whose head is padded beyond the tokenizer (Qwen's 151936 rows for
    151643 tokens) spread probability over every row, so this, not the
    tokenizer's size, bounds the entropy.
    """
    from rltk.models.wrappers import unwrap_model

    model = unwrap_model(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = head.weight.shape[0] if head is not None and head.weight.dim() == 2 else 0
    # ZeRO-3 leaves an empty placeholder in a partitioned module; the config still knows.
    return int(rows) if rows > 0 else int(model.config.vocab_size)


def _named_strategies(strategies) -> list[tuple[str, Any]]:
    """``[(name, strategy)]`` of what a loop checkpoints: one strategy, or a policy-and-critic pair."""
    if hasattr(strategies, "policy") and hasattr(strategies, "critic"):
        return [("policy", strategies.policy), ("critic", strategies.critic)]
    return [("policy", strategies)]


def _local_parameters(module: torch.nn.Module):
    """``(name, tensor)`` of the part of each parameter this rank holds."""
    for name, p in module.named_parameters():
        shard = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps this rank's partition here; p is a placeholder
        if shard is None:
            shard = p.to_local() if hasattr(p, "to_local") else p  # an FSDP2 DTensor's local shard
        yield name, shard.detach()


def first_nonfinite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first parameter (of this rank's shard) holding nan or inf, or None.

    One reduction per parameter, gathered in one tensor so the device is
    synchronised once, not once per parameter.
    """
    named = [(n, t) for n, t in _local_parameters(module) if t.numel()]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).cpu()
    bad = (~finite).nonzero()
    return named[int(bad[0])][0] if len(bad) else None


def _agreed(strategy, flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any: ranks must stop at the same step or the rest hang."""
    if strategy is None or strategy.data_world_size == 1:
        return flag
    return bool(strategy.all_reduce_sum(torch.tensor([float(flag)])).item() > 0)


@dataclass(frozen=True)
class _Verdict:
    symptom: str
    at: int  # global step
    what: str  # the symptom in words, for the message
    good_before: int  # a checkpoint is good if its global step is below this
    knob: str  # the guard key that tunes this check


class DivergenceGuard:
    """Watches one stage's metrics and weights; raises :class:`TrainingDiverged` on a symptom (module doc).

    Call :meth:`observe` after logging each step's metrics, :meth:`check_weights`
    before each checkpoint (``StageCheckpoint.save`` does), and :meth:`end_stage`
    when the stage's loop returns (``run_stages`` does). Its counters travel in
    every checkpoint (:meth:`state_dict`), so a resumed run counts on.
    """

    def __init__(self, cfg: DictConfig, *, stage_name: str, stage_type: str, first_step: int, vocab_size: int,
                 checkpoints=None):
        """``cfg`` is the stage's config; ``checkpoints`` the run's CheckpointManager (to name the last good one)."""
        self.settings = GuardSettings.from_config(cfg)
        self.lr_key = "sft.lr" if stage_type == "sft" else "trainer.lr"
        self.lr = OmegaConf.select(cfg, self.lr_key)
        self.stage_name = stage_name
        self.first_step = first_step
        self.vocab_size = vocab_size
        self.log_vocab = math.log(vocab_size) if vocab_size > 1 else 0.0
        self.checkpoints = checkpoints
        # counters (see state_dict)
        self.armed = False  # the entropy has been below the uniform line in this stage
        self.entropy_streak, self.entropy_since, self.entropy_side = 0, 0, ""
        self.idle_streak, self.idle_since = 0, 0
        self.trained_steps, self.idle_steps = 0, 0
        self.last_step = 0  # the latest stage step observed
        self.idle_reason = "updates skipped"  # the latest idle step's reason, for the message

    # ---------------------------------------------------------------- checks

    def observe(self, metrics: dict[str, Any], step: int, strategies=None) -> None:
        """Check one logged step (``step`` counts within the stage); raise TrainingDiverged on a symptom.

        ``strategies`` is what the loop checkpoints (a strategy, or the ppo
        recipe's policy-and-critic pair): its weights are checked every
        ``guard.check_weights_every`` steps. Collective with several processes.
        """
        if not self.settings.enabled:
            return
        at = self.first_step + step
        self.last_step = step
        verdict = self._nothing_trained(metrics, at) or self._entropy(metrics, at)
        every = self.settings.check_weights_every
        strategy = _named_strategies(strategies)[0][1] if strategies is not None else None
        if _agreed(strategy, verdict is not None):
            raise self._diverged(verdict or _Verdict(
                "elsewhere", at, "another process's divergence guard found a symptom at this step (its log names it)",
                at - 1, "guard.enabled"))
        if strategies is not None and every and step % every == 0:
            self.check_weights(strategies, step)

    def check_weights(self, strategies, step: int) -> None:
        """Raise TrainingDiverged if a weight of the policy (or critic) is nan or inf. Collective."""
        if not self.settings.enabled:
            return
        at = self.first_step + step
        for name, strategy in _named_strategies(strategies):
            bad = first_nonfinite_parameter(strategy.unwrap())
            if _agreed(strategy, bad is not None):
                where = f" ({bad} is the first parameter holding nan or inf)" if bad else " (on another process)"
                # every checkpoint was checked before it was written, so each of them is good
                raise self._diverged(_Verdict(
                    "nonfinite_weights", at, f"the {name}'s weights are not finite{where}: every later step would "
                    f"compute nan", at + 1, "guard.check_weights_every"))

    def end_stage(self, strategy=None) -> None:
        """At the end of a stage: raise if it observed steps and not one of them trained anything. Collective."""
        if not self.settings.enabled:
            return
        at = self.first_step + self.last_step
        if _agreed(strategy, not self.trained_steps and self.idle_steps > 0):
            raise self._diverged(_Verdict(
                "nothing_trained", at, f"the stage ended and none of its {self.idle_steps} step(s) applied an update "
                f"({self.idle_reason})", self.first_step + self.idle_since - 1, "guard.max_skipped_steps"))

    # ---------------------------------------------------------------- symptoms

    def _nothing_trained(self, metrics: dict[str, Any], at: int):
        skipped = {k: float(metrics[k]) for k in SKIPPED_KEYS if k in metrics}
        losses = {k: float(metrics[k]) for k in LOSS_KEYS if k in metrics}
        if not skipped and not losses:
            return None  # no update this step (e.g. an empty batch, or the policy waiting for the critic)
        nonfinite = [k for k, v in losses.items() if not math.isfinite(v)]
        idle = [k for k, v in skipped.items() if v >= 1.0]
        if not nonfinite and not idle:
            self.idle_streak = 0
            self.trained_steps += 1
            return None
        if self.idle_streak == 0:
            self.idle_since = at - self.first_step
        self.idle_streak += 1
        self.idle_steps += 1
        reasons = [f"{k}={losses[k]}" for k in nonfinite]
        reasons += [f"every optimizer step of the {SKIPPED_KEYS[k]} skipped for a non-finite gradient norm"
                    + (f" (grad_norm={metrics[g]})" if (g := k.replace("skipped", "grad_norm")) in metrics else "")
                    for k in idle]
        self.idle_reason = "; ".join(reasons)
        limit = self.settings.max_skipped_steps
        if not limit or self.idle_streak < limit:
            return None
        since = self.first_step + self.idle_since
        return _Verdict("nothing_trained", at, f"{self.idle_streak} steps in a row trained nothing (since step "
                        f"{since}): {self.idle_reason}", since - 1, "guard.max_skipped_steps")

    def _entropy(self, metrics: dict[str, Any], at: int):
        key = next((k for k in ENTROPY_KEYS if k in metrics), None)
        if key is None or not self.log_vocab:
            return None
        entropy = float(metrics[key])
        if not math.isfinite(entropy):
            return None  # a non-finite forward: the loss is non-finite too and counts as nothing trained
        fraction = entropy / self.log_vocab
        s = self.settings
        # bounds compared in nats: the band [min, max] x log(V) is inclusive, exactly
        floor, ceiling = s.entropy_min * self.log_vocab, s.entropy_max * self.log_vocab
        if entropy <= ceiling:
            self.armed = True
        side = "zero" if entropy < floor else "uniform" if self.armed and entropy > ceiling else ""
        if not side:
            self.entropy_streak, self.entropy_side = 0, ""
            return None
        if side != self.entropy_side:
            self.entropy_streak, self.entropy_since, self.entropy_side = 0, at - self.first_step, side
        self.entropy_streak += 1
        if self.entropy_streak < s.entropy_patience:
            return None
        since = self.first_step + self.entropy_since
        where = (f"above guard.entropy_max={s.entropy_max}: the policy collapsed to uniform output"
                 if side == "uniform" else
                 f"below guard.entropy_min={s.entropy_min}: the policy collapsed onto single tokens")
        # the entropy at step k is that of the weights step k-1 left
        return _Verdict(f"entropy_{side}", at, f"mean token entropy ({key}) has been {entropy:.4g} nats, "
                        f"{fraction:.2%} of the uniform distribution's log(V={self.vocab_size}) = "
                        f"{self.log_vocab:.4g}, for {self.entropy_streak} steps in a row (since step {since}), {where}",
                        since - 1, "guard.entropy_patience")

    # ---------------------------------------------------------------- message

    def last_good_checkpoint(self, good_before: int) -> Path | None:
        """The newest complete checkpoint whose global step is below ``good_before``, if one remains."""
        if self.checkpoints is None:
            return None
        good = [path for step, path in self.checkpoints.checkpoints() if step < good_before]
        return good[-1] if good else None

    def _diverged(self, v: _Verdict) -> TrainingDiverged:
        at, good_before = v.at, v.good_before
        checkpoint = self.last_good_checkpoint(good_before)
        if checkpoint is not None:
            where = (f"Last good checkpoint: {checkpoint} (`rltk export {checkpoint} DIR` makes it a model folder a "
                     f"new run can start from with model.path=DIR)")
        elif self.checkpoints is not None and self.checkpoints.checkpoints():
            where = (f"No checkpoint from before step {good_before} is left (none was written, or checkpoint.keep_last "
                     f"pruned it); those present were written after the symptom began")
        else:
            where = "No good checkpoint: none was written before the symptom began (checkpoint.every sets how often)"
        message = (f"training diverged at step {at} (step {at - self.first_step} of stage '{self.stage_name}'): "
                   f"{v.what}. The usual cause is a learning rate too high ({self.lr_key}={self.lr}). {where}. "
                   f"To tune this check see {v.knob}; guard.enabled=false turns the guard off")
        return TrainingDiverged(message, symptom=v.symptom, step=at, checkpoint=checkpoint)

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """The counters, JSON-able, for the checkpoint's state."""
        return {"armed": self.armed, "entropy_streak": self.entropy_streak, "entropy_since": self.entropy_since,
                "entropy_side": self.entropy_side, "idle_streak": self.idle_streak, "idle_since": self.idle_since,
                "trained_steps": self.trained_steps, "idle_steps": self.idle_steps, "last_step": self.last_step,
                "idle_reason": self.idle_reason}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue counting from a checkpoint's :meth:`state_dict` (a checkpoint without one: from zero)."""
        for key, value in state.items():
            if key in self.state_dict():
                setattr(self, key, value)
