"""The served model and its LoRA adapters: one adapter (and one Adam) per training client.

One copy of the base model is held; every training client gets a peft adapter of its own on it
(``add_adapter``), and every sampler a frozen copy of an adapter's weights taken when the client
called ``save_weights_for_sampler``, so a sampler keeps sampling from the weights it was made
from while training goes on. Only the active adapter's weights take part in a forward pass and
only they require gradients, so clients never touch each other's weights.

Every method runs on the service's single worker thread (:mod:`rltk.tinker_service.futures`):
peft's active adapter is global state of the module, and an engine is not thread-safe.

The log-probs of a datum are rltk's fused token log-prob op (:mod:`rltk.kernels`) over the
model's last hidden states: position ``i`` of ``model_input`` scores ``target_tokens[i]``, as in
Tinker, so targets need not be the shifted input.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rltk.tinker_service.losses import LossPlan, compute_loss

#: LoRA's scale is alpha / rank; Tinker fixes alpha at 32.
LORA_ALPHA = 32.0
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
OPTIMIZER_FILE = "optimizer.pt"


@dataclass
class Adapter:
    """A training client's adapter: its rank, its parameters and the optimizer over them."""

    rank: int
    parameters: list[nn.Parameter] = field(default_factory=list)
    optimizer: torch.optim.AdamW | None = None
    steps: int = 0


def _targets(model: nn.Module, train_attn: bool, train_mlp: bool) -> list[str]:
    from rltk.models.lora import linear_modules

    wanted = (ATTENTION if train_attn else ()) + (MLP if train_mlp else ())
    present = {name.rsplit(".", 1)[-1] for name in linear_modules(model)}
    return [name for name in wanted if name in present]  # none: another architecture, every linear but the head


class Workspace:
    """The base model with its adapters and samplers; see the module docstring."""

    def __init__(self, model: nn.Module, tokenizer: Any, processor: Any = None):
        self.base = model
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's: image chunks are read (rltk.tinker_service.images)
        self.peft_model: nn.Module | None = None
        self.adapters: dict[str, Adapter] = {}
        self.samplers: dict[str, str] = {}  # sampler id -> the adapter name holding its frozen weights
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.device = next(model.parameters()).device

    # ------------------------------------------------------------------ adapters

    def create(self, name: str, rank: int, *, seed: int | None = None, train_attn: bool = True,
               train_mlp: bool = True) -> None:
        """A new adapter ``name`` of ``rank`` (B = 0: the model is the base model until the first step)."""
        import peft

        from rltk.models.lora import vision_tower_pattern

        targets = _targets(self.base, train_attn, train_mlp)
        # a VLM's vision tower has its own gate/up/down projections: LoRA adapts the language model only
        config = peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                                 target_modules=targets or "all-linear",
                                 exclude_modules=vision_tower_pattern(self.base))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            if self.peft_model is None:
                self.peft_model = peft.get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft_model.add_adapter(name, config)
        self.adapters[name] = Adapter(rank=rank, parameters=self._parameters_of(name))

    def _parameters_of(self, name: str) -> list[nn.Parameter]:
        marker = f".{name}."
        return [p for n, p in self.peft_model.named_parameters() if marker in n]

    def _activate(self, name: str | None) -> contextlib.AbstractContextManager:
        """Make ``name`` the active adapter (``None``: the base model) for the block."""
        if name is None:
            return self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext()
        self.peft_model.set_adapter(name)
        for p in self.peft_model.parameters():  # set_adapter marks the active one trainable; samplers stay frozen
            p.requires_grad_(False)
        for p in self.adapters[name].parameters if name in self.adapters else ():
            p.requires_grad_(True)
        return contextlib.nullcontext()

    def drop(self, name: str) -> None:
        """Forget adapter ``name`` (a training client's or a sampler's) and its optimizer."""
        self.adapters.pop(name, None)
        if self.peft_model is not None and name in self.peft_model.peft_config:
            self.peft_model.delete_adapter(name)

    def adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        import peft

        return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(self.peft_model, adapter_name=name).items()}

    # ------------------------------------------------------------------ training

    def token_logprobs(self, name: str | None, tokens: list[list[int]], targets: list[list[int]],
                       visions: list | None = None) -> torch.Tensor:
        """Log-prob of ``targets[b][i]`` after ``tokens[b][: i + 1]``, right-padded with 0. Shape: (B, T).

        ``visions[b]``: row ``b``'s images (:class:`rltk.batch.PromptImages`, None without), whose tokens
        ``tokens[b]`` holds; the model places their features there."""
        from rltk.models.vision.inputs import batch_vision_inputs

        from rltk.kernels import token_logprobs_and_entropy
        from rltk.kernels.excluded_tokens import exclude_tokens
        from rltk.kernels.logprobs import IGNORE_INDEX
        from rltk.models.vision.tower import vision_token_ids
        from rltk.models.logprobs import last_hidden_states, logit_temperature_factor, output_head

        model = self.peft_model if self.peft_model is not None else self.base
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long, device=self.device)
        labels = torch.full_like(ids, IGNORE_INDEX)
        mask = torch.zeros_like(ids)
        for row, (toks, tgts) in enumerate(zip(tokens, targets)):
            ids[row, : len(toks)] = torch.tensor(toks)
            labels[row, : len(tgts)] = torch.tensor(tgts)
            mask[row, : len(toks)] = 1
        with self._activate(name):
            vision = batch_vision_inputs(visions, self.device) if visions else None
            hidden = last_hidden_states(model, ids, mask, vision_inputs=vision)  # [B, T, D]; i predicts label i
            weight, bias = output_head(model)
            dtype = torch.promote_types(hidden.dtype, weight.dtype)
            hidden, weight = hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype)
            bias, temperature = None if bias is None else bias.to(dtype), logit_temperature_factor(model)
            outputs = token_logprobs_and_entropy(hidden, weight, labels.reshape(-1), bias=bias,
                                                 temperature=temperature)
            # the sampler (the hf engine) never draws a VLM's image tokens: score the softmax without them too
            logprobs = exclude_tokens(outputs, hidden, weight, bias, labels.reshape(-1), vision_token_ids(model),
                                      temperature=temperature)[0]
        return logprobs.view(len(tokens), width) * mask

    def forward_backward(self, name: str, plan: LossPlan, data: list, *, forward_only: bool):
        """Per-datum log-probs and element-wise losses, the loss's metrics; gradients accumulate unless
        ``forward_only`` (the next ``optim_step`` applies them)."""
        model = self.peft_model
        was_training = model.training
        model.train(not forward_only)
        try:
            with torch.set_grad_enabled(not forward_only):
                tokens = [d.tokens for d in data]
                targets = [d.inputs["target_tokens"].astype("int64").tolist() for d in data]
                logprobs = self.token_logprobs(name, tokens, targets, [getattr(d, "vision", None) for d in data])
                mask = (torch.arange(logprobs.shape[1], device=self.device)[None, :]
                        < torch.tensor([len(t) for t in tokens], device=self.device)[:, None]).to(logprobs.dtype)
                inputs = {key: self._padded(data, key, logprobs.shape) for key in ("weights", "logprobs", "advantages")
                          if all(key in d.inputs for d in data)}
                loss, metrics = compute_loss(plan, logprobs, mask, inputs)
                if not forward_only:
                    loss.backward()
        finally:
            model.train(was_training)
        weights = inputs.get("weights", torch.ones_like(logprobs))
        per_token_loss = (-weights * logprobs).detach() if plan.tinker_name == "cross_entropy" else None
        outputs = []
        for row, toks in enumerate(tokens):
            out = {"logprobs": logprobs[row, : len(toks)].detach().float().cpu().numpy()}
            if per_token_loss is not None:
                out["elementwise_loss"] = per_token_loss[row, : len(toks)].float().cpu().numpy()
            outputs.append(out)
        return outputs, metrics

    def _padded(self, data: list, key: str, shape) -> torch.Tensor:
        out = torch.zeros(shape, dtype=torch.float32, device=self.device)
        for row, d in enumerate(data):
            values = torch.as_tensor(d.inputs[key].astype("float32"))
            out[row, : len(values)] = values
        return out

    def optim_step(self, name: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step on adapter ``name`` with this call's hyperparameters; gradients are cleared."""
        adapter = self.adapters[name]
        if adapter.optimizer is None:
            adapter.optimizer = torch.optim.AdamW(adapter.parameters, lr=lr, betas=(beta1, beta2), eps=eps,
                                                  weight_decay=weight_decay)
        for group in adapter.optimizer.param_groups:  # Tinker's hyperparameters come with every step
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in adapter.parameters if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else None
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(adapter.parameters, grad_clip_norm)
        adapter.optimizer.step()
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.steps += 1
        return {"grad_norm:mean": float(norm) if norm is not None else 0.0}

    # ------------------------------------------------------------------ samplers

    def add_sampler(self, sampler_id: str, source: str | None) -> None:
        """A sampler frozen at adapter ``source``'s current weights (``None``: the base model)."""
        import peft

        if source is None:
            self.samplers[sampler_id] = None
            return
        name = f"sampler_{sampler_id}"
        config = self.peft_model.peft_config[source]
        self.peft_model.add_adapter(name, config)
        state = peft.get_peft_model_state_dict(self.peft_model, adapter_name=source)
        peft.set_peft_model_state_dict(self.peft_model, state, adapter_name=name)
        for p in self._parameters_of(name):
            p.requires_grad_(False)
        self.samplers[sampler_id] = name

    def add_sampler_from_folder(self, sampler_id: str, folder: Path) -> None:
        """A sampler from a saved adapter folder (``save_weights_for_sampler`` with a name)."""
        name = f"sampler_{sampler_id}"
        self._load_adapter_folder(name, folder)
        for p in self._parameters_of(name):
            p.requires_grad_(False)
        self.samplers[sampler_id] = name

    def drop_sampler(self, sampler_id: str) -> None:
        name = self.samplers.pop(sampler_id, None)
        if name is not None:
            self.drop(name)

    def sample(self, sampler_id: str, prompt: list[int], params, stop_strings: list[str], *,
               prompt_logprobs: bool,
               vision=None) -> tuple[list[tuple[list[int], list[float], str]], list[float] | None]:
        """``params.n`` completions of ``prompt`` from a sampler: ``(tokens, logprobs, reason)`` each; ``vision``
        the prompt's images (:class:`rltk.batch.PromptImages`), whose tokens ``prompt`` holds."""
        from rltk.rollout.hf import HFRolloutEngine

        name = self.samplers[sampler_id]
        model = self.peft_model if self.peft_model is not None else self.base
        with self._activate(name), torch.no_grad():
            engine = HFRolloutEngine(model, self.tokenizer)
            completions = (engine.generate([prompt], params, vision_inputs=[vision]) if vision is not None
                           else engine.generate([prompt], params))[0]
            scored = None
            if prompt_logprobs and len(prompt) > 1:
                scored = [math.nan] + self.token_logprobs(name, [prompt[:-1]], [prompt[1:]],
                                                          None if vision is None else [vision])[0].tolist()
            elif prompt_logprobs:
                scored = [math.nan]
        sequences = [_cut_at_strings(c.token_ids, c.logprobs, c.finish_reason, stop_strings, self.tokenizer)
                     for c in completions]
        return sequences, scored

    # ------------------------------------------------------------------ state on disk

    def save(self, name: str, folder: Path, *, optimizer: bool) -> None:
        """Adapter ``name`` as a standard peft adapter folder (what ``PeftModel.from_pretrained`` and
        ``model.lora.path`` read), with its Adam state when ``optimizer``."""
        import copy

        from safetensors.torch import save_file

        from rltk.models.lora import ADAPTER_WEIGHTS_FILE

        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.to("cpu").contiguous() for k, v in self.adapter_state(name).items()}
        save_file(state, str(folder / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        config = copy.deepcopy(self.peft_model.peft_config[name])
        config.inference_mode = True
        config.save_pretrained(str(folder))
        adapter = self.adapters.get(name)
        if optimizer and adapter is not None and adapter.optimizer is not None:
            torch.save({"optimizer": adapter.optimizer.state_dict(), "steps": adapter.steps}, folder / OPTIMIZER_FILE)

    def load(self, name: str, folder: Path, *, optimizer: bool) -> None:
        """Adapter ``name``'s weights (and, when asked and saved, its Adam state) from a saved folder."""
        import peft
        from safetensors.torch import load_file

        from rltk.models.lora import ADAPTER_WEIGHTS_FILE

        state = load_file(str(folder / ADAPTER_WEIGHTS_FILE), device=str(self.device))
        result = peft.set_peft_model_state_dict(self.peft_model, state, adapter_name=name)
        missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if missing:
            raise ValueError(f"the saved adapter has weights this model lacks: {missing[:3]}")
        adapter = self.adapters[name]
        adapter.optimizer = None
        if optimizer and (folder / OPTIMIZER_FILE).is_file():
            saved = torch.load(folder / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
            adapter.optimizer = torch.optim.AdamW(adapter.parameters)
            adapter.optimizer.load_state_dict(saved["optimizer"])
            adapter.steps = int(saved["steps"])

    def create_from_folder(self, name: str, folder: Path) -> int:
        """A new training adapter ``name`` shaped like the saved one; returns its rank."""
        from rltk.models.lora import adapter_config

        config = adapter_config(folder)
        modules = set(config.get("target_modules") or [])
        rank = int(config["r"])
        self.create(name, rank, train_attn=bool(modules & set(ATTENTION)) or not modules,
                    train_mlp=bool(modules & set(MLP)) or not modules)
        return rank

    def _load_adapter_folder(self, name: str, folder: Path) -> None:
        self.create_from_folder(name, folder)
        self.load(name, folder, optimizer=False)
        self.adapters.pop(name, None)  # a sampler: no optimizer, never trained


def _cut_at_strings(tokens: list[int], logprobs: list[float], reason: str, stop_strings: list[str],
                    tokenizer) -> tuple[list[int], list[float], str]:
    """Cut a completion after the first token whose text completes one of ``stop_strings``."""
    if not stop_strings:
        return list(tokens), list(logprobs), reason
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end], skip_special_tokens=False)
        if any(s in text for s in stop_strings):
            return list(tokens[:end]), list(logprobs[:end]), "stop"
    return list(tokens), list(logprobs), reason
