"""Rollout engine ``hf``: batched ``transformers`` generation, colocated with the trainer.

The engine samples from the very module the trainer optimises, so there is
nothing to synchronise after an optimizer step; it runs anywhere torch runs
(CPU included) and is the default engine. Qwen2 and Llama models are sampled
by a loop of its own (:mod:`rltk.rollout.hf_sampling`: ``generate``'s tokens
and log-probs with less compute); every other model by ``model.generate``.

Under a strategy that shards parameters (DeepSpeed ZeRO-3) that module is no
model on its own: every forward gathers parameters, a collective, so ranks
would have to generate in lockstep and an evaluation on one rank would hang.
The engine then samples from a whole copy of its own (:meth:`HFRolloutEngine.use_model`
with ``strategy.full_model_copy()``), and :meth:`HFRolloutEngine.update_weights`
given the trainer's sharded module gathers its parameters, one at a time, into
that copy (a collective then, which every rank calls after every optimizer step).

Log-probs. Every completion token carries the log-prob of the distribution it
was drawn from:

* sampling: ``log softmax(filter_top_p(filter_top_k(logits / temperature)))``
  at that step, i.e. temperature first, then top-k, then top-p, tokens
  outside the kept set having probability 0. This is exactly the
  distribution ``torch.multinomial`` drew from, so ``exp`` of the sum over a
  completion is its sampling probability (what an importance ratio against
  the rollout policy needs).
* greedy: the temperature-1 log-probs ``log softmax(logits)`` of the argmax
  token (the top-k/top-p filters would make every greedy token log-prob 0).
* a vision-language model: its image and video tokens get probability 0 first
  (:func:`rltk.models.vision.tower.vision_token_ids`), so every log-prob above
  is that of the distribution renormalised without them.

They are recorded by a logits processor placed after the sampling filters,
one ``[N]`` vector per step, instead of through ``output_scores``, which would
keep ``max_new_tokens`` tensors of ``[N, vocab]`` floats alive (tens of GB for
a 150k vocabulary).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import rltk
from rltk.models.kv_cache import cache_keyword
from rltk.models.moe import is_moe
from rltk.models.sharding import has_sharded_parameters, iter_full_state
from rltk.models.vision.inputs import batch_vision_inputs, token_type_ids
from rltk.models.vision.tower import forget_rope_deltas, vision_token_ids
from rltk.models.wrappers import unwrap_model
from rltk.notices import notice_once
from rltk.rollout.base import (
    Completion, ModelAndTokenizer, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids,
)
from rltk.rollout.hf_routing import GenerationRouting, record_generation_routing
from rltk.rollout.hf_sampling import sample, sampling_blocker, shared_prompts

logger = logging.getLogger(__name__)


class _SampledTokenLogprobs:
    """Logits processor that records the log-prob of each token ``generate`` picks.

    At step ``t`` it receives the final (filtered) scores and keeps their
    log-softmax; at step ``t + 1`` the token chosen at ``t`` is the last
    column of ``input_ids``, and its log-prob is gathered. The last step's
    token is gathered in :meth:`finish`. Memory: one ``[N, vocab]`` buffer.
    """

    def __init__(self):
        self.steps: list[torch.Tensor] = []  # each [N]
        self.pending: torch.Tensor | None = None  # [N, V] log-probs waiting for their chosen token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Log-probs ``[N, L]`` of the ``[N, L]`` generated tokens."""
        length = generated.shape[1]
        steps = self.steps[:length]  # generate may undo speculative trailing steps
        if len(steps) < length:
            steps.append(self.pending.gather(1, generated[:, len(steps) : len(steps) + 1]).squeeze(1))
        if len(steps) != length:
            raise RuntimeError(
                f"internal error: recorded {len(steps)} log-prob steps for {length} generated tokens"
            )
        if length == 0:
            return torch.zeros(generated.shape, dtype=torch.float32)
        return torch.stack(steps, dim=1)


@contextlib.contextmanager
def _neutral_generation_config(model: nn.Module):
    """Hide the checkpoint's ``generation_config`` during ``generate``.

    ``generate`` fills every unset field from ``model.generation_config``, so a
    checkpoint shipping e.g. ``repetition_penalty: 1.05`` or ``top_k: 20``
    would silently change the sampling distribution (and break the log-prob
    contract). Everything rltk wants is passed explicitly instead.
    """
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Run with a fixed RNG seed without disturbing the caller's RNG state."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class HFRolloutEngine(ModelAndTokenizer, RolloutEngine):
    """Rollouts from the training model itself (registered as ``hf``), by ``model.generate`` or,
    for Qwen2 and Llama, :func:`rltk.rollout.hf_sampling.sample`.

    Args:
        model: a ``transformers`` causal LM (possibly wrapped by DDP or
            Accelerate); the engine keeps a reference, so it always samples
            from the current weights.
        tokenizer: decodes completion text and supplies eos / pad ids.
        batch_size: sequences per ``generate`` call (prompts x ``n``); lower it
            when generation runs out of memory.
        device: where inputs are placed; defaults to the model's device.

    Prompts are left-padded with an attention mask, so a batch gives the same
    completions as one prompt at a time. The model is put in eval mode under
    ``torch.no_grad()`` while generating and returned to its previous mode.
    The ``n`` completions of a prompt are generated as ``n`` repeated rows.
    """

    samples_from_module = True  # the trainer's own module: nothing to copy after an optimizer step
    runs_in_producer = True  # a producer's own copy of the policy, reading the trainer's weights file
    returns_routed_experts = True  # an MoE policy's routers are hooked while it samples (rltk.rollout.hf_routing)

    def __init__(self, model: nn.Module, tokenizer: Any, *, batch_size: int = 64, device: Any = None):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(
                f"rollout engine 'hf': batch_size (rollout.engine_args.batch_size) must be an integer >= 1 "
                f"(sequences per generate call), got {batch_size!r}"
            )
        if not isinstance(model, nn.Module) or not hasattr(unwrap_model(model, through_peft=False), "generate"):
            raise TypeError(
                f"rollout engine 'hf' needs a transformers causal LM with .generate(), got {type(model).__name__}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else None

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 vision_inputs: list | None = None) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt; see the module docstring for log-probs.

        ``vision_inputs``: a VLM's images of each prompt, a :class:`rltk.batch.PromptImages` (what the
        ``single_turn`` workflow hands every engine: the decoded images and the processor's ``pixel_values``
        and ``image_grid_thw``; this engine reads the latter) or a dict of those two, None for a prompt
        without images; ``prompt_ids`` already hold their expanded placeholders (:mod:`rltk.models.vision.inputs`).
        """
        prompt_ids = validate_prompt_ids(prompt_ids)
        if vision_inputs is not None and len(vision_inputs) != len(prompt_ids):
            raise ValueError(f"rollout engine 'hf': {len(vision_inputs)} vision inputs for {len(prompt_ids)} prompts")
        model = unwrap_model(self.model, through_peft=False)
        device = self.device or next(model.parameters()).device
        stop_ids = self._stop_token_ids(params)
        pad_id = self._pad_token_id(stop_ids)

        # Row r of the flattened request list is sample r % n of prompt r // n.
        rows = [(index, ids) for index, ids in enumerate(prompt_ids) for _ in range(params.n)]
        results: list[list[Completion]] = [[] for _ in prompt_ids]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), _seeded(params.seed, device), _neutral_generation_config(model):
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start : start + self.batch_size]
                    vision = None if vision_inputs is None else batch_vision_inputs(
                        [vision_inputs[index] for index, _ in chunk], device)
                    generated, logprobs, routing = self._generate_chunk(
                        model, [ids for _, ids in chunk], params, stop_ids, pad_id, device, vision
                    )
                    width = max(len(ids) for _, ids in chunk)
                    for row, ((index, ids), token_row, logprob_row) in enumerate(zip(chunk, generated, logprobs)):
                        tokens, lps, reason = cut_at_stop(token_row, logprob_row, stop_ids, params.max_new_tokens)
                        routed = None if routing is None else GenerationRouting.completion(
                            routing, row, width, len(ids), len(tokens))
                        results[index].append(Completion(index, tokens, lps, reason, self._decode(tokens),
                                                         routed_experts=routed))
        finally:
            model.train(was_training)
        return results

    def _generate_chunk(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: list[int],
        pad_id: int,
        device: torch.device,
        vision: dict | None = None,
    ) -> tuple[list[list[int]], list[list[float]], torch.Tensor | None]:
        """Generated tokens and their log-probs per row, and an MoE policy's routing (``[N, W + steps, L, k]``,
        :class:`rltk.rollout.hf_routing.GenerationRouting`; None for a dense one)."""
        from transformers import GenerationConfig, LogitsProcessorList
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1

        # The sampling filters are ours, not generate's: generate appends its
        # own warpers after user processors, and the recorder must see the
        # scores actually sampled from, so it goes last in this list.
        recorder = _SampledTokenLogprobs()
        processors = LogitsProcessorList()
        suppressed = vision_token_ids(model)
        if suppressed:  # a VLM: image placeholders get probability 0 in every response (vision_token_ids)
            from transformers.generation.logits_process import SuppressTokensLogitsProcessor

            processors.append(SuppressTokensLogitsProcessor(suppressed, device=device))
        if not params.greedy:
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                processors.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=params.top_p))
        processors.append(recorder)

        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        blocker = sampling_blocker(model) if vision is None else "the prompts have images"
        if blocker is None:
            generated = sample(model, input_ids, attention_mask, max_new_tokens=params.max_new_tokens,
                               greedy=params.greedy, stop_ids=stop_ids, pad_id=pad_id, logits_processor=processors)
            return generated.tolist(), recorder.finish(generated).tolist(), None
        notice_once(logger, "the hf engine samples through generate, not its own loop", blocker)

        # Neutral values switch generate's own warpers off (its default top_k is 50).
        neutral_sampling = {} if params.greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            do_sample=not params.greedy,
            num_beams=1,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stop_ids or None,
            pad_token_id=pad_id,
            use_cache=True,
            **neutral_sampling,
        )
        # an MoE policy's routers are recorded over every forward, the shared prompt prefill included
        recording = record_generation_routing(model) if is_moe(model) else contextlib.nullcontext()
        # a VLM's rotary offsets of its last forward must not reach this batch, and its prompts run in full:
        # the shared prefill would leave offsets for the distinct prompts, not for the rows (forget_rope_deltas)
        with recording as routing:
            # inside the recording: the shared prefill's routing is the prompt's
            shared = {} if forget_rope_deltas(model) else _shared_prompt_cache(model, input_ids, attention_mask)
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=processors,
                **shared,
                **(vision or {}),
                # the processor's token types: the model builds its 3-D rotary positions from them
                **({"mm_token_type_ids": token_type_ids(input_ids, model)} if vision else {}),
            )
        generated = sequences[:, width:]  # [N, L], L <= max_new_tokens
        logprobs = recorder.finish(generated)  # [N, L]
        routed = routing.rows(input_ids, attention_mask) if routing is not None else None
        return generated.tolist(), logprobs.tolist(), routed

    def _pad_token_id(self, stop_ids: list[int]) -> int:
        # Only used for left padding (masked out) and for rows that already
        # stopped (cut off), so any valid id works when the tokenizer has none.
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is not None:
            return pad
        return stop_ids[0] if stop_ids else 0

    # ------------------------------------------------------------------ weights

    def use_model(self, model: nn.Module) -> None:
        """Sample from ``model`` from now on: the trainer's module (shared, nothing to copy after a step)
        or a whole copy of the engine's own (when the trainer shards its parameters)."""
        if not isinstance(model, nn.Module) or not hasattr(unwrap_model(model, through_peft=False), "generate"):
            raise TypeError(
                f"rollout engine 'hf' needs a transformers causal LM with .generate(), got {type(model).__name__}"
            )
        self.model = model

    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Load new weights into the model the engine samples from (``version`` and ``interrupt`` do not apply).

        The trainer's own module (the usual colocated case) is a no-op, since
        the engine already holds it. Another module, or a state dict with the
        names of ``model.state_dict()``, is copied in; tied weights (e.g. an
        lm_head sharing the embedding) may be given under either name. A
        module with sharded parameters (ZeRO-3, FSDP2) is gathered one tensor
        at a time straight into the engine's copy: a collective then, to be
        called on every rank.
        """
        target = unwrap_model(self.model, through_peft=False)
        if isinstance(state_dict_or_model, nn.Module):
            source = unwrap_model(state_dict_or_model, through_peft=False)
            if source is target:
                return
            if has_sharded_parameters(source):
                self._copy_gathered(source, target)
                return
            state = source.state_dict()
        elif isinstance(state_dict_or_model, Mapping):
            state = state_dict_or_model
        else:
            raise TypeError(
                f"HFRolloutEngine.update_weights takes an nn.Module or a state dict, "
                f"got {type(state_dict_or_model).__name__}"
            )
        try:
            with torch.no_grad():
                result = target.load_state_dict(state, strict=False)
        except RuntimeError as exc:
            raise ValueError(f"HFRolloutEngine.update_weights: the state dict does not fit the model: {exc}") from exc
        missing = _untied_missing_keys(target, result.missing_keys, set(state))
        if missing or result.unexpected_keys:
            raise ValueError(
                "HFRolloutEngine.update_weights: the state dict does not match the model's parameter names; "
                f"missing {len(missing)}: {missing[:5]}, unexpected {len(result.unexpected_keys)}: "
                f"{list(result.unexpected_keys)[:5]}"
            )

    @staticmethod
    def _copy_gathered(source: nn.Module, target: nn.Module) -> None:
        """Copy every tensor of a sharded ``source`` into ``target`` as it is gathered (collective)."""
        live = target.state_dict(keep_vars=True)
        copied, unexpected, mismatched = set(), [], []
        with torch.no_grad():
            # Every rank walks the whole iterator, whatever it finds: the gathers are collectives.
            for name, full in iter_full_state(source):
                if name not in live:
                    unexpected.append(name)
                elif live[name].shape != full.shape:
                    mismatched.append(f"{name}: model {tuple(live[name].shape)} vs given {tuple(full.shape)}")
                else:
                    live[name].copy_(full)
                    copied.add(name)
        missing = _untied_missing_keys(target, [k for k in live if k not in copied], copied)
        if missing or unexpected or mismatched:
            raise ValueError(
                "HFRolloutEngine.update_weights: the trainer's module does not match the engine's model; "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatches {mismatched[:3]}"
            )


def _shared_prompt_cache(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """``{keyword: cache}`` holding every row's prompt but its last token, computed once per distinct
    prompt, or ``{}`` when no two rows share a prompt or the model keeps no ``DynamicCache``. The
    keyword is the one the model's forward declares (:mod:`rltk.models.kv_cache`), which ``generate``
    passes on to it.

    The ``n`` samples of a prompt are ``n`` identical rows, and a causal LM's states over identical
    prefixes are identical: the prefill runs on the distinct prompts and its keys and values are
    indexed out to the rows. ``generate`` then runs only the uncached last prompt token before
    sampling (a cache must leave it one token to process). With groups of 8 this takes 7/8 of the
    prefill away.

    A LoRA policy is a ``peft.PeftModel``, whose ``forward`` declares its own arguments and hands
    every other keyword (the cache among them) to the base model, where the adapter layers sit: the
    keyword is read from the base model's forward, and the prefill runs through the wrapper, as
    ``generate`` does.
    """
    from transformers import DynamicCache

    base = unwrap_model(model)  # through peft: the causal LM whose forward takes the cache
    # a sharded module gathers its parameters collectively in every forward: no extra forward on one rank
    supports_cache = getattr(base, "_supports_default_dynamic_cache", lambda: True)()
    if has_sharded_parameters(model) or getattr(base, "_is_stateful", False) or not supports_cache:
        return {}
    keyword = cache_keyword(base.forward)
    if keyword is None:
        notice_once(logger, "generate runs every row's prompt in full",
                    f"{type(base).__name__}.forward declares neither `cache` nor `past_key_values`")
        return {}
    prompt_of_row, first_rows = shared_prompts(input_ids, attention_mask)
    if prompt_of_row is None:
        return {}
    ids, mask = input_ids[first_rows, :-1], attention_mask[first_rows, :-1]
    cache = DynamicCache(config=getattr(base, "config", None))
    # the prefill's logits are not needed: keep the head to one position where the model allows it
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0),
          use_cache=True, **keep, **{keyword: cache})
    cache.batch_select_indices(prompt_of_row)
    return {keyword: cache}


def _untied_missing_keys(model: nn.Module, missing: list[str], given: set[str]) -> list[str]:
    """Missing keys that no given key shares storage with (tied weights are fine)."""
    if not missing:
        return []
    tensors = dict(model.state_dict(keep_vars=True))
    given_ptrs = {tensors[k].data_ptr() for k in given if k in tensors}
    return [k for k in missing if k not in tensors or tensors[k].data_ptr() not in given_ptrs]


@rltk.hookimpl
def rltk_rollout_engines():
    return {"hf": HFRolloutEngine}
