"""Rollout engine ``vllm``: vLLM (>= 0.8) colocated with the trainer on the same GPUs.

Each training process owns an in-process ``vllm.LLM`` on its own GPU(s); the
trainer pushes its full weights in after every update
(:meth:`VLLMRolloutEngine.update_weights`) and can put the engine to sleep
while it trains (:meth:`~VLLMRolloutEngine.sleep` frees the KV cache and moves
the weights to CPU memory; :meth:`~VLLMRolloutEngine.wake_up` restores them).

Colocation choices, and why:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set unless already set) keeps vLLM's
  engine core in this process, so weight updates hand tensors over directly
  instead of pickling the whole model through a pipe.
* Under a multi-process launcher (``WORLD_SIZE > 1``), vLLM uses
  ``distributed_executor_backend="external_launcher"``: each rank is one vLLM
  worker and ``tensor_parallel_size`` ranks share one model.
* Without ``model_path`` the engine is built from the trainer's config with
  ``load_format="dummy"`` and then receives the trainer's weights, so a model
  built in memory (rltk's tiny default) needs no checkpoint on disk.
* vLLM never tokenizes (``skip_tokenizer_init``): prompts arrive as token ids
  and completions are decoded with rltk's tokenizer, so ids cannot drift
  between the trainer and the engine.

Log-probs follow the ``hf`` engine: every request asks for the sampled
token's log-prob (``logprobs=0``) and each :class:`~rltk.rollout.base.Completion`
carries one per token, which the workflows keep as the batch's
``rollout_logprobs`` (what ``algorithm.use_rollout_logprobs`` and
``algorithm.rollout_correction`` read). With
``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) they are those of the
distribution sampled from (after temperature, top-k, top-p); older vLLM
returns temperature-1 log-probs of the raw logits and the engine warns once.
Greedy decoding gives temperature-1 log-probs in both cases.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
from torch import nn

import rltk
from rltk.models.sharding import has_sharded_parameters, iter_full_state
from rltk.rollout.base import Completion, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids
from rltk.rollout.hf import unwrap_model

MIN_VLLM_VERSION = (0, 8)
_USE_HF = "Set rollout.engine=hf to generate with transformers instead (any device, CPU included)."


def _import_vllm():
    """``import vllm``, or an error a person can act on."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"rollout.engine=vllm needs the 'vllm' package (>= {'.'.join(map(str, MIN_VLLM_VERSION))}, "
            f"on a CUDA machine: pip install 'rltk[vllm]'), but importing it failed: "
            f"{type(exc).__name__}: {exc}. {_USE_HF}"
        ) from exc
    version = _version_tuple(getattr(vllm, "__version__", "0"))
    if version < MIN_VLLM_VERSION:
        raise ImportError(
            f"rollout.engine=vllm needs vllm >= {'.'.join(map(str, MIN_VLLM_VERSION))}, found "
            f"{vllm.__version__}. Upgrade it (pip install -U vllm) or {_USE_HF[0].lower()}{_USE_HF[1:]}"
        )
    return vllm


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "rollout.engine=vllm needs a CUDA GPU, but torch sees none (torch.cuda.is_available() is "
            f"False). {_USE_HF}"
        )


def _engine_arg_names(vllm) -> set[str]:
    """Field names of ``vllm.EngineArgs`` (what ``LLM(**kwargs)`` accepts in this version)."""
    engine_args = getattr(vllm, "EngineArgs", None)
    if engine_args is None or not dataclasses.is_dataclass(engine_args):
        return set()
    return {f.name for f in dataclasses.fields(engine_args)}


def vllm_request_kwargs(params: SamplingParams, stop_token_ids: Sequence[int], seed: int | None, n: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one request of ``n`` samples.

    ``logprobs=0`` asks for the sampled token's log-prob only; ``ignore_eos``
    makes ``stop_token_ids`` (eos included unless the caller chose otherwise)
    the only stop condition, matching the ``hf`` engine; vLLM switches top-k
    off with ``-1`` and decodes greedily at temperature 0.
    """
    kwargs = {
        "n": n,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": True,
        "detokenize": False,
        "seed": seed,
    }
    if params.greedy:
        kwargs.update(temperature=0.0, top_p=1.0, top_k=-1)
    else:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1)
    return kwargs


def completions_from_outputs(
    request_outputs: Sequence[Any],
    prompt_indices: Sequence[int],
    stop_token_ids: Sequence[int],
    max_new_tokens: int,
    decode: Callable[[list[int]], str],
) -> list[Completion]:
    """Map vLLM ``RequestOutput`` objects to :class:`Completion` objects.

    ``prompt_indices[i]`` is the prompt that request ``i`` sampled for. Each
    request's outputs are read in their ``index`` order; the log-prob of token
    ``t`` at position ``p`` is ``output.logprobs[p][t].logprob``. Finish
    reasons are recomputed with :func:`rltk.rollout.base.cut_at_stop`, so
    they mean exactly what they mean for the ``hf`` engine.
    """
    completions = []
    for request, prompt_index in zip(request_outputs, prompt_indices):
        for output in sorted(request.outputs, key=lambda o: o.index):
            if getattr(output, "finish_reason", None) == "abort":
                raise RuntimeError(f"vLLM aborted a request for prompt {prompt_index}; see vLLM's log above")
            token_ids = list(output.token_ids)
            if output.logprobs is None or len(output.logprobs) < len(token_ids):
                raise RuntimeError(
                    f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} log-prob entries "
                    f"for {len(token_ids)} tokens of prompt {prompt_index}; was logprobs=0 dropped?"
                )
            logprobs = [float(output.logprobs[p][token].logprob) for p, token in enumerate(token_ids)]
            tokens, lps, reason = cut_at_stop(token_ids, logprobs, stop_token_ids, max_new_tokens)
            completions.append(Completion(prompt_index, tokens, lps, reason, decode(tokens)))
    return completions


def _load_weights_on_worker(worker, weights):
    """Runs inside each vLLM worker (via ``LLM.collective_rpc``): load HF-named full tensors.

    vLLM's model ``load_weights`` takes checkpoint names and full tensors and
    shards them itself under tensor parallelism.
    """
    model = worker.model_runner.model
    loaded = model.load_weights(weights=weights)
    return len(loaded) if loaded is not None else len(weights)


def engine_weights(state_dict_or_model: Any, trainer_model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The plain Hugging Face weights vLLM loads, from a module or a state dict of the trainer's model.

    A module whose parameters are sharded (ZeRO-3, FSDP2) is gathered one
    tensor at a time (a collective). A LoRA model (peft) has its adapters merged
    into the base weights, ``W = W0 + (alpha / r) B A``
    (:func:`rltk.models.lora.merge_lora_weights`), under the base model's own
    names (no ``base_model.model.`` prefix, no ``.base_layer``, no ``lora_*``
    entries), since vLLM builds the plain architecture. A state dict with
    peft's names takes its scalings from ``trainer_model``, the module it was
    read from.
    """
    from rltk.models.lora import lora_scalings, merge_lora_weights

    if isinstance(state_dict_or_model, nn.Module):
        module = unwrap_model(state_dict_or_model)  # sees through peft: the base model, adapter layers inside
        sharded = has_sharded_parameters(module)
        source = iter_full_state(module) if sharded else module.state_dict().items()
        scalings = lora_scalings(module)
    elif isinstance(state_dict_or_model, Mapping):
        sharded, source = False, state_dict_or_model.items()
        lora = any(".lora_A." in name for name in state_dict_or_model)
        if lora and trainer_model is None:
            raise ValueError("engine_weights: a state dict with LoRA adapters needs the trainer's model for their "
                             "scalings (alpha / r)")
        scalings = lora_scalings(_peft_or_self(trainer_model)) if lora else {}
    else:
        raise TypeError(
            f"VLLMRolloutEngine.update_weights takes an nn.Module or a state dict, "
            f"got {type(state_dict_or_model).__name__}"
        )
    if scalings:
        source = merge_lora_weights(source, scalings)
    # a gathered ZeRO-3 tensor is partitioned again when the next one is gathered: keep copies
    return {name: tensor.clone() if sharded else tensor for name, tensor in source}


def _peft_or_self(model: nn.Module) -> nn.Module:
    """The PeftModel inside ``model``'s wrappers (its state-dict names are peft's), else ``model``."""
    from rltk.models.lora import is_lora_model, peft_model_of

    return peft_model_of(model) if is_lora_model(model) else model


def _write_model_skeleton(model: nn.Module, tokenizer: Any, path: str) -> None:
    """Config, generation config and tokenizer of ``model``: what vLLM needs to build it with dummy weights."""
    model.config.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(path)


class VLLMRolloutEngine(RolloutEngine):
    """Rollouts with an in-process ``vllm.LLM`` sharing the trainer's GPUs (registered as ``vllm``).

    Args:
        model: the trainer's model (possibly wrapped); its config describes the
            model to build and, without ``model_path``, its weights are loaded
            into vLLM at construction.
        tokenizer: decodes completion text and supplies the eos id.
        model_path: a local folder or hub id to load weights from instead.
        tensor_parallel_size: GPUs per vLLM instance.
        gpu_memory_utilization: fraction of each GPU vLLM may take (weights
            and KV cache); leave room for training.
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake_up`.
        sleep_level: 1 offloads weights to CPU and drops the KV cache; 2 drops
            both (the next :meth:`update_weights` must then bring weights).
        dtype: vLLM's dtype (``"auto"``, ``"bfloat16"``, ``"float32"`` ...).
        max_model_len: longest prompt + completion; defaults to the model's.
        enforce_eager: skip CUDA graph capture (faster start, slower decode).
        enable_prefix_caching: reuse KV of shared prompt prefixes (the ``n``
            samples of a prompt); the cache is reset after each weight update.
        seed: vLLM's engine seed (offset by ``RANK // tensor_parallel_size``).
        engine_kwargs: anything else for ``vllm.LLM(...)``, passed through.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        model_path: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ):
        vllm = _import_vllm()
        _require_cuda()
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(
                f"rollout.engine_args.tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}"
            )
        if not isinstance(gpu_memory_utilization, (int, float)) or not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"rollout.engine_args.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
            )
        if sleep_level not in (1, 2):
            raise ValueError(f"rollout.engine_args.sleep_level must be 1 or 2, got {sleep_level!r}")
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size % tensor_parallel_size != 0:
            raise ValueError(
                f"rollout.engine_args.tensor_parallel_size={tensor_parallel_size} must divide the number of "
                f"training processes (WORLD_SIZE={world_size}); each group of ranks shares one vLLM model"
            )

        self.model = model
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.enable_prefix_caching = enable_prefix_caching
        self._asleep: set[str] = set()  # memory tags currently released

        unwrapped = unwrap_model(model)
        load_format = "auto"
        if model_path is None:
            self._skeleton_dir = tempfile.mkdtemp(prefix="rltk-vllm-")
            weakref.finalize(self, shutil.rmtree, self._skeleton_dir, ignore_errors=True)
            _write_model_skeleton(unwrapped, tokenizer, self._skeleton_dir)
            model_path, load_format = self._skeleton_dir, "dummy"

        accepted = _engine_arg_names(vllm)
        kwargs: dict[str, Any] = dict(
            model=model_path,
            skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=float(gpu_memory_utilization),
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
            # One seed per tensor-parallel group: the ranks of a group must
            # sample identically, different groups must not.
            seed=seed + int(os.environ.get("RANK", "0")) // tensor_parallel_size,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.logprobs_are_processed = "logprobs_mode" in accepted
        if self.logprobs_are_processed:
            kwargs["logprobs_mode"] = "processed_logprobs"
        else:
            warnings.warn(
                f"vllm {vllm.__version__} has no logprobs_mode: rollout log-probs are temperature-1 log-probs "
                f"of the raw logits, not of the sampling distribution. Recompute old log-probs in the trainer "
                f"(algorithm.use_rollout_logprobs=false), leave algorithm.rollout_correction off (its ratios "
                f"would compare against the wrong distribution unless rollout.temperature=1 with no top-k/top-p), "
                f"or upgrade to vllm >= 0.10.2.",
                stacklevel=2,
            )
        kwargs.update(engine_kwargs or {})
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        if load_format == "dummy":
            self.update_weights(model)

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt (waking a sleeping engine first)."""
        prompt_ids = validate_prompt_ids(prompt_ids)
        if self._asleep:
            self.wake_up()
        stop_ids = self._stop_token_ids(params)
        prompts, sampling, owners = [], [], []
        for index, ids in enumerate(prompt_ids):
            if params.seed is None:
                requests = [(None, params.n)]
            else:
                # One seeded request per sample: distinct, reproducible streams
                # that do not depend on how vLLM fans out n > 1.
                requests = [(params.seed + index * params.n + j, 1) for j in range(params.n)]
            for seed, n in requests:
                prompts.append({"prompt_token_ids": ids})
                sampling.append(self._vllm.SamplingParams(**vllm_request_kwargs(params, stop_ids, seed, n)))
                owners.append(index)
        outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False)
        completions = completions_from_outputs(outputs, owners, stop_ids, params.max_new_tokens, self._decode)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for completion in completions:
            grouped[completion.prompt_index].append(completion)
        return grouped

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        if params.stop_token_ids is not None:
            return list(params.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(unwrap_model(self.model).config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, state_dict_or_model: Any) -> None:
        """Copy the trainer's full weights (a module or an HF-named state dict) into vLLM.

        A module whose parameters are sharded (ZeRO-3, FSDP2) is gathered one
        tensor at a time (:func:`rltk.models.sharding.iter_full_state`): a
        collective, so every rank must call this, and each full tensor is
        copied out before the next is gathered. A sleeping engine wakes its
        weights (not its KV cache) first; the prefix cache is reset because
        cached keys and values belong to the old weights. A LoRA policy's
        adapters are merged into the weights on the way (:func:`engine_weights`).
        """
        state = engine_weights(state_dict_or_model, self.model)
        if self._asleep:
            self._wake(["weights"])
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        if self.enable_prefix_caching:
            self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free GPU memory for training: ``llm.sleep(level=sleep_level)``; a no-op without sleep mode."""
        if not self.enable_sleep_mode or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Restore weights and KV cache after :meth:`sleep`."""
        if self._asleep:
            self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        # Waking by tag (vLLM >= 0.8.5) lets weights be loaded before the KV
        # cache is allocated again, lowering the memory peak of a sync; each
        # tag is woken once, since a second wake of the same memory is not a
        # no-op in every version.
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            pending = [tag for tag in tags if tag in self._asleep]
            if pending:
                self.llm.wake_up(tags=pending)
            self._asleep = self._asleep - set(pending)
        else:
            self.llm.wake_up()
            self._asleep = set()


@rltk.hookimpl
def rltk_rollout_engines():
    return {"vllm": VLLMRolloutEngine}
