"""The rollout-engine contract: sampling parameters in, completions out.

A rollout engine turns prompt token ids into completions: the sampled token
ids, the log-prob of each under the distribution it was drawn from, and why
generation stopped. It also accepts new weights from the trainer, and may free
its accelerator memory between rollouts (``sleep`` / ``wake_up``).

Engines are registered under the kind ``rollout_engine`` and constructed as
``cls(model=..., tokenizer=..., **rollout.engine_args)`` by a recipe.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

FINISH_REASONS = ("stop", "length")
#: The ``Experience.info`` key a workflow puts a completion's per-token ``versions`` under (when the engine
#: records them); an asynchronous run's producer moves them into the experience queue.
POLICY_VERSIONS = "policy_versions"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CONFIG_KEYS = {"n", "temperature", "top_p", "top_k", "max_new_tokens"}  # set from rollout.<field> by recipes


def _field(name: str) -> str:
    """How an error names a field: the dataclass field, and the config key that sets it."""
    return f"SamplingParams.{name} (config key rollout.{name})" if name in _CONFIG_KEYS else f"SamplingParams.{name}"


@dataclass
class SamplingParams:
    """How to sample completions; validated on construction.

    Args:
        n: completions per prompt (a GRPO group size), ``>= 1``.
        temperature: softmax temperature, ``> 0``; ignored when ``greedy``.
        top_p: nucleus sampling mass in ``(0, 1]``; ``1`` keeps every token.
        top_k: keep only the ``top_k`` most likely tokens; ``0`` turns it off.
        max_new_tokens: completion length limit, ``>= 1``.
        stop_token_ids: token ids that end a completion. ``None`` means the
            tokenizer's eos token; ``[]`` means only ``max_new_tokens`` stops.
        greedy: take the argmax at every step (evaluation); ``n`` copies of a
            greedy completion are identical.
        seed: makes one ``generate`` call reproducible; ``None`` draws from the
            process-wide RNG.

    ``dataclasses.replace(params, n=1, greedy=True)`` derives evaluation
    parameters and re-runs the validation.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: list[int] | None = None
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"{_field('n')} must be an integer >= 1 (completions per prompt), got {self.n!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"{_field('max_new_tokens')} must be an integer >= 1, got {self.max_new_tokens!r}"
            )
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"{_field('top_k')} must be an integer >= 0 (0 turns top-k off), got {self.top_k!r}"
            )
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"{_field('temperature')} must be a number > 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"{_field('temperature')} must be a finite number > 0, got {self.temperature!r}; "
                f"for argmax decoding set greedy=True instead of temperature=0"
            )
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"{_field('top_p')} must be a number in (0, 1], got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"{_field('top_p')} must be in (0, 1] (1 keeps every token), got {self.top_p!r}"
            )
        self.top_p = float(self.top_p)
        if not isinstance(self.greedy, bool):
            raise ValueError(f"{_field('greedy')} must be true or false, got {self.greedy!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"{_field('seed')} must be an integer or None, got {self.seed!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Sequence):
                raise ValueError(
                    f"{_field('stop_token_ids')} must be a list of token ids or None (eos), "
                    f"got {self.stop_token_ids!r}"
                )
            bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
            if bad:
                raise ValueError(
                    f"{_field('stop_token_ids')} must hold non-negative integer token ids, "
                    f"got {list(self.stop_token_ids)!r} (bad: {bad!r})"
                )
            self.stop_token_ids = list(self.stop_token_ids)


@dataclass
class Completion:
    """One sampled continuation of one prompt.

    ``token_ids`` end with the stop token when ``finish_reason == "stop"``
    (the policy must learn to emit it, so it is trained on like any other
    token); with ``"length"`` they are exactly ``max_new_tokens`` long.
    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the distribution
    it was sampled from (see the engine for what that means precisely).
    ``versions[i]``, when the engine records it (server engines), is the
    policy (weights) version that sampled ``token_ids[i]``: a completion whose
    generation a weight update interrupted holds two or more versions, in
    non-decreasing order. ``None`` means the engine's weights of the call.
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    versions: list[int] | None = None
    # an MoE policy's experts per token: [len(prompt) + len(token_ids)][L][k], the prompt's real tokens then
    # the response's, -1 on the last (never run); None from an engine that does not record routing
    routed_experts: list | None = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Completion has {len(self.logprobs)} logprobs for {len(self.token_ids)} tokens"
            )
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(
                f"Completion has {len(self.versions)} versions for {len(self.token_ids)} tokens"
            )


class RolloutEngine(abc.ABC):
    """Generates completions for prompt token ids and follows the trainer's weights.

    Implementations: ``hf`` (:class:`rltk.rollout.hf.HFRolloutEngine`, any
    device), ``vllm`` (:class:`rltk.rollout.vllm_engine.VLLMRolloutEngine`,
    CUDA) and ``vllm_server`` (:class:`rltk.rollout.vllm_server.VLLMServerEngine`,
    inference servers over HTTP, on :class:`rltk.rollout.server_pool.ServerPoolEngine`).
    A plugin engine subclasses this (or the server pool) and registers under
    ``rltk_rollout_engines``.

    What an engine can do beyond generating is declared here, each with a
    default the trainer can rely on: the class attributes say which way it
    follows weights and what the trainer may ask of it (validation and the
    loop read them from the class, never from the engine's name), and the methods below that are not abstract do nothing
    (or say they cannot) unless the engine overrides them.
    """

    #: The engine samples from a torch module it is pointed at with :meth:`use_model` (``hf``): the trainer
    #: hands it its own module, so an optimizer step needs no copy. Otherwise it holds weights of its own and
    #: gets new ones through :meth:`update_weights`.
    samples_from_module: ClassVar[bool] = False
    #: The weights live in other processes (inference servers) that can load a weights file themselves
    #: (:meth:`load_weights_file`), also while generating (``interrupt``): ``vllm_server``.
    loads_weight_files: ClassVar[bool] = False
    #: The engine can sample in an asynchronous run's producer process (``trainer.mode=one_step_off`` or
    #: ``async``): it is built there from the config and follows the weights the trainer publishes, by its own
    #: module (``hf``) or by having its servers load the file (:attr:`loads_weight_files`). ``vllm`` cannot: it
    #: shares the trainer's process and memory.
    runs_in_producer: ClassVar[bool] = False
    #: The engine samples on inference servers it launches (``engine_args.launch``) or is given
    #: (``engine_args.servers``), and loads every weight version into them (:mod:`rltk.rollout.server_pool`). In
    #: an asynchronous run they are the producer's, so the trainer evaluates with ``hf`` on its own module, and
    #: given servers take one producer (two would load their versions into the same servers).
    owns_servers: ClassVar[bool] = False
    #: Completions of an MoE policy carry the experts each token went through (``routed_experts``), which
    #: ``algorithm.routing_replay=rollout`` replays in the trainer (:mod:`rltk.models.moe`): ``hf``.
    returns_routed_experts: ClassVar[bool] = False
    #: Whether completions carry per-token ``versions`` (set by an asynchronous producer on engines that
    #: load weights mid-generation; others ignore it).
    track_versions: bool = False
    #: Samples continued after a weight load interrupted them (engines that interrupt; else stays 0).
    continued: int = 0
    #: Seconds one call to another process may take (engines with servers).
    timeout_s: float = 120.0

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions for every prompt.

        Returns one list per prompt, in prompt order, each holding ``params.n``
        :class:`Completion` objects whose ``prompt_index`` is that prompt's
        position in ``prompt_ids``.
        """

    @abc.abstractmethod
    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Make the engine sample from new weights.

        Accepts the trainer's model (an ``nn.Module``) or a full state dict
        whose names match the model's ``state_dict()``. ``version`` labels the
        weights (per-token ``versions``) and ``interrupt`` lets the load stop
        generation in flight; both matter only to engines with
        :attr:`loads_weight_files`, and the trainer passes them only to those.
        """

    def use_model(self, model: Any) -> None:
        """Sample from ``model`` from now on (engines with :attr:`samples_from_module` only)."""
        raise NotImplementedError(f"rollout engine {type(self).__name__} holds weights of its own: give it new "
                                  f"ones with update_weights")

    def load_weights_file(self, path: str, version: int, *, interrupt: bool = False) -> bool:
        """Have the engine's processes load the safetensors file ``path`` as weights ``version`` themselves;
        False when it cannot (engines without :attr:`loads_weight_files`, or a file whose names are not the
        model's): then read the file into a module and call :meth:`update_weights`."""
        return False

    def sleep(self) -> None:
        """Free accelerator memory between rollouts; a no-op where that means nothing."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next :meth:`generate`; a no-op by default."""

    def close(self) -> None:
        """Release what the engine holds (processes, connections, process groups); a no-op by default."""


class ModelAndTokenizer:
    """Mixin for engines that hold the trainer's ``model`` (possibly wrapped) and its ``tokenizer``: which
    tokens end a completion (:func:`stop_token_ids`), and a completion's text."""

    model: Any
    tokenizer: Any

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        from rltk.models.wrappers import unwrap_model  # torch: here, so that reading SamplingParams needs none

        model = unwrap_model(self.model, through_peft=False)
        return stop_token_ids(params, self.tokenizer, getattr(model, "config", None))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""


def stop_token_ids(params: SamplingParams, tokenizer: Any, model_config: Any) -> list[int]:
    """The tokens that end a completion: ``params.stop_token_ids`` where given, else the tokenizer's EOS,
    else the model config's (one id or several), else none."""
    if params.stop_token_ids is not None:
        return list(params.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def validate_prompt_ids(prompt_ids: Any) -> list[list[int]]:
    """Check that ``prompt_ids`` is a list of non-empty lists of ints, naming the bad prompt."""
    if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Sequence):
        raise TypeError(
            f"prompt_ids must be a list of token-id lists (one per prompt), got {type(prompt_ids).__name__}"
        )
    checked = []
    for index, ids in enumerate(prompt_ids):
        if hasattr(ids, "tolist"):  # a tensor or array row
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(
                f"prompt_ids[{index}] must be a list of token ids, got {type(ids).__name__}; "
                f"tokenize text prompts first"
            )
        if len(ids) == 0:
            raise ValueError(
                f"prompt_ids[{index}] is empty; every prompt needs at least one token "
                f"(an empty prompt gives the model nothing to condition on)"
            )
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise TypeError(f"prompt_ids[{index}] must hold non-negative integer token ids, got {list(ids)[:8]!r}...")
        checked.append(list(ids))
    return checked


def cut_at_stop(
    token_ids: Sequence[int], logprobs: Sequence[float], stop_token_ids: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[float], str]:
    """Truncate one generated row at its first stop token, keeping that token.

    Returns ``(token_ids, logprobs, finish_reason)``: up to and including the
    first token in ``stop_token_ids`` with reason ``"stop"``, otherwise the
    first ``max_new_tokens`` tokens with reason ``"length"``. Anything an
    engine wrote after the stop (padding of finished rows) is dropped.
    """
    stops = set(stop_token_ids)
    for position, token in enumerate(token_ids[:max_new_tokens]):
        if token in stops:
            return list(token_ids[: position + 1]), list(logprobs[: position + 1]), "stop"
    return list(token_ids[:max_new_tokens]), list(logprobs[:max_new_tokens]), "length"
