"""The critic of PPO: a causal-LM backbone with a scalar value head.

:class:`ValueModel` reads a sequence with the decoder stack of a causal LM (the
Hugging Face base model, without its LM head) and maps every final hidden
state to one number, the estimated return ``V(s_t)`` of the state "everything
up to and including token ``t``". :func:`response_values` aligns those numbers
with the response tokens of a batch (:mod:`rltk.batch`) exactly as
:func:`rltk.models.logprobs.response_logprobs` aligns log-probs: the hidden
state at position ``P - 1 + t`` has seen the prompt and the first ``t``
response tokens, i.e. the state in which response token ``t`` is chosen, so
``values[:, t]`` is the value GAE pairs with the reward of token ``t``.

A critic is built from the policy (:func:`build_critic_from_policy`: a deep copy
of its backbone plus a new head, as in Ouyang et al. 2022 where the value model
starts from a trained model rather than from scratch) or loaded from a folder
(:func:`load_value_model`: a critic saved by :meth:`ValueModel.save_pretrained`,
or any HF causal-LM folder whose backbone then gets a new head).

Folder layout written by :meth:`ValueModel.save_pretrained` (also what the
training strategies write under ``<checkpoint>/critic/model/``, since they call
``save_pretrained`` on modules that have one)::

    config.json          the backbone's Hugging Face config (AutoConfig-loadable)
    value_model.json     {"format": "rltk-value-model-v1", "backbone_class": ..., "hidden_size": ...}
    model.safetensors    backbone.* and value_head.* weights
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from rltk.models.logprobs import base_model, hidden_of_output, positions_from_mask, replay_layout
from rltk.models.wrappers import unwrap_model
from rltk.models.packing import pack_rows

__all__ = [
    "VALUE_MODEL_FILE",
    "ValueModel",
    "build_critic_from_policy",
    "load_value_model",
    "response_values",
]

VALUE_MODEL_FILE = "value_model.json"
VALUE_MODEL_FORMAT = "rltk-value-model-v1"


def _hidden_size(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text_config, "hidden_size", None)
    if not isinstance(hidden, int):
        raise ValueError(
            f"cannot read the hidden size from the backbone's config ({type(config).__name__}): it has no integer "
            "'hidden_size'. Build ValueModel(backbone, hidden_size=...) yourself."
        )
    return hidden


class ValueModel(nn.Module):
    """A causal-LM backbone plus ``value_head = Linear(hidden_size, 1)``: per-position values.

    Args:
        backbone: a decoder stack returning final (normed) hidden states, e.g. the
            ``.model`` of a ``Qwen2ForCausalLM`` (see :func:`build_critic_from_policy`).
            Called as ``backbone(input_ids=, attention_mask=, position_ids=, use_cache=False)``.
        hidden_size: width of the backbone's hidden states; read from
            ``backbone.config`` when omitted.
        head_init_std: standard deviation of the head's initial weight. The
            default 0 (weight and bias zero) makes the untrained critic predict 0
            everywhere, so before the critic has learned anything GAE reduces to
            the (discounted) reward-to-go instead of adding random-head noise to
            the advantages; the head still learns at once, since its gradient is
            ``sum (V - R) h``, and the backbone receives gradient from the second
            step on.

    The head always runs in fp32 (outside any autocast): values are regression
    targets compared across steps, where bf16's 8 bits of mantissa would show.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None, *, head_init_std: float = 0.0):
        super().__init__()
        if hidden_size is None:
            if getattr(backbone, "config", None) is None:
                raise ValueError(
                    f"ValueModel: the backbone {type(backbone).__name__} has no .config to read hidden_size from; "
                    "pass hidden_size=..."
                )
            hidden_size = _hidden_size(backbone.config)
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"ValueModel: hidden_size={hidden_size!r} must be a positive integer")
        if not (isinstance(head_init_std, (int, float)) and head_init_std >= 0):
            raise ValueError(f"ValueModel: head_init_std={head_init_std!r} must be a number >= 0 (0 = zero init)")
        self.backbone = backbone
        param = next(backbone.parameters(), None)
        self.value_head = nn.Linear(hidden_size, 1, device=param.device if param is not None else None,
                                    dtype=torch.float32)
        with torch.no_grad():
            if head_init_std > 0:
                self.value_head.weight.normal_(0.0, head_init_std)
            else:
                self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    @property
    def config(self):
        """The backbone's Hugging Face config (saved as ``config.json`` of the critic's folder)."""
        return getattr(self.backbone, "config", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Value of every position: ``V[b, s] = value_head(h[b, s])``, fp32.

        ``position_ids`` default to :func:`rltk.models.logprobs.positions_from_mask`
        (left-padded rows get the positions they had at generation time).
        ``attention_mask=None`` with position ids restarting per sequence is a
        packed row (:mod:`rltk.models.packing`): attention stays within each sequence.
        Values on padding positions are whatever the head says of them: mask them.

        Shape: (B, S), (B, S), (B, S) -> (B, S).
        """
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        output = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = hidden_of_output(output, who=f"ValueModel: the backbone {type(self.backbone).__name__}",
                                   advice="give ValueModel a decoder stack (e.g. model.model of a "
                                          "*ForCausalLM), not the full causal LM")
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return self.value_head(hidden.float()).squeeze(-1)  # [B, S]

    def gradient_checkpointing_enable(self) -> None:
        """Recompute the backbone's activations in the backward pass (HF backbones only; non-reentrant,
        see :mod:`rltk.models.activation_checkpointing`)."""
        from rltk.models.activation_checkpointing import enable_activation_checkpointing

        try:
            enable_activation_checkpointing(self.backbone)
        except ValueError as exc:
            raise NotImplementedError(
                f"the critic's backbone {type(self.backbone).__name__} supports no activation checkpointing; "
                "set model.gradient_checkpointing=false"
            ) from exc

    # ---------------------------------------------------------------- folders

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        **_: object) -> None:
        """Write the critic as a folder :func:`load_value_model` reads (layout in the module docstring).

        ``state_dict`` (full CPU tensors, e.g. a strategy's gathered weights)
        replaces the module's own; the training strategies pass it this way.
        """
        from safetensors.torch import save_file

        from rltk.io import give_default_mode

        if self.config is None or not hasattr(self.config, "to_json_string"):
            raise ValueError(
                f"ValueModel.save_pretrained: the backbone {type(self.backbone).__name__} has no Hugging Face "
                "config, so the folder could not be loaded again; save the state_dict yourself."
            )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        meta = {
            "format": VALUE_MODEL_FORMAT,
            "backbone_class": type(unwrap_model(self.backbone)).__name__,
            "hidden_size": self.value_head.in_features,
        }
        (directory / VALUE_MODEL_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        state = self.state_dict() if state_dict is None else state_dict
        # safetensors refuses tensors sharing storage; clone so tied weights save as copies.
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
        give_default_mode([directory / "model.safetensors"])


def build_critic_from_policy(policy: nn.Module, *, head_init_std: float = 0.0) -> ValueModel:
    """A new critic whose backbone is a deep copy of ``policy``'s decoder stack, with a fresh value head.

    The copy shares nothing with the policy (training one never moves the
    other); the policy's LM head is left out. ``policy`` may be wrapped (DDP,
    DeepSpeed engine), but not sharded: build the critic before wrapping.
    The copy is put in train mode: ``policy`` may be a frozen reference in eval mode.
    """
    from rltk.models.lora import is_lora_model, merged_copy

    if is_lora_model(policy):
        # A LoRA policy's adapters are part of "the policy as the stage begins": the critic (trained
        # whole, by its own optimizer) starts from the merged weights, with no adapter layers.
        policy = merged_copy(policy)
    inner = unwrap_model(policy)
    decoder = base_model(inner)
    if decoder is None:
        raise ValueError(
            f"build_critic_from_policy: cannot find the decoder stack of {type(inner).__name__} "
            "(no get_decoder(), .model or .base_model); build ValueModel(backbone, hidden_size) yourself."
        )
    backbone = copy.deepcopy(decoder).train().requires_grad_(True)
    hidden_size = _hidden_size(getattr(inner, "config", None) or backbone.config)
    return ValueModel(backbone, hidden_size, head_init_std=head_init_std)


def load_value_model(path: str | Path, *, dtype: str = "float32", head_init_std: float = 0.0,
                     config_key: str = "critic.model_path") -> ValueModel:
    """A critic from the local folder ``path``.

    * A folder written by :meth:`ValueModel.save_pretrained` (it has
      ``value_model.json``) comes back with its trained head.
    * Any Hugging Face causal-LM folder (e.g. an SFT checkpoint or a reward
      model saved as a causal LM) gives its backbone plus a fresh head
      (:func:`build_critic_from_policy`).

    ``config_key`` names the config entry ``path`` came from, for errors.
    """
    from transformers import AutoConfig, AutoModel

    from rltk.models.loading import DTYPES, load_model
    from rltk.models.folders import load_full_state_into, load_model_folder

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{config_key}='{path}' is not a folder. Give a critic folder (written by ValueModel.save_pretrained, "
            f"e.g. <checkpoint>/critic/model) or a local Hugging Face causal-LM folder, or null to copy the "
            "policy's backbone."
        )
    meta_file = folder / VALUE_MODEL_FILE
    if not meta_file.is_file():
        return build_critic_from_policy(load_model(folder, dtype=dtype, config_key=config_key),
                                        head_init_std=head_init_std)
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != VALUE_MODEL_FORMAT:
        raise ValueError(
            f"{config_key}='{path}': {VALUE_MODEL_FILE} has format {meta.get('format')!r}; this rltk reads "
            f"{VALUE_MODEL_FORMAT!r}"
        )
    if dtype not in DTYPES or DTYPES[dtype] == "auto":
        raise ValueError(f"load_value_model: dtype='{dtype}' must be one of float32, bfloat16, float16")
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    backbone = AutoModel.from_config(config, dtype=DTYPES[dtype])
    critic = ValueModel(backbone, int(meta["hidden_size"]))
    load_full_state_into(critic, load_model_folder(folder), folder)
    return critic


def response_values(
    critic: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    *,
    pack: bool = False,
    routed_experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values of the states before each response token, aligned with :mod:`rltk.batch`.

    With prompts left-padded to ``P = S - T`` and responses right-padded to
    ``T``, ``values[:, t] = V(h[:, P - 1 + t])``: the value of the state that
    has read the prompt and response tokens ``< t`` (the state in which token
    ``t`` is chosen), the same positions whose hidden states give the
    log-probs. The last column is never read (no state follows the last
    token), so it is not fed to the critic. Position ids come from the
    attention mask. Response padding (``attention_mask == 0``) gets 0.

    ``critic`` is a :class:`ValueModel`, possibly wrapped (DDP, FSDP2, a
    DeepSpeed engine): it is called through its own forward, so gradient sync
    and unsharding hooks run. Differentiable.

    ``pack=True`` runs the critic on the real tokens only, packed into one row
    with position ids restarting per sequence (:mod:`rltk.models.packing`):
    the same values up to float rounding, without the padding's compute.

    ``routed_experts`` (``[B, S, L, k]``, an MoE critic only): the experts the
    rollout engine routed each token to, replayed in the critic's routers as in
    the policy's forwards (R3, :func:`rltk.models.moe.route`), so values and
    log-probs of a token are computed by the same experts.

    Shape: (B, S), (B, S), int T -> (B, T) fp32.
    """
    if routed_experts is not None:
        from rltk.models.moe import route

        with route(critic, replay_layout(routed_experts, attention_mask, pack=pack)[0]):
            return response_values(critic, input_ids, attention_mask, response_width, pack=pack)
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"response_values: input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must be the same [B, S]"
        )
    batch_size, seq_len = input_ids.shape
    if isinstance(response_width, bool) or not isinstance(response_width, int) or not 0 <= response_width < seq_len:
        raise ValueError(
            f"response_values: response_width={response_width!r} must be an int in [0, S={seq_len}): at least "
            "one prompt column must precede the response"
        )
    if response_width == 0:
        return torch.zeros(batch_size, 0, dtype=torch.float32, device=input_ids.device)
    prompt_len = seq_len - response_width
    if pack:
        packed = pack_rows(input_ids, attention_mask, response_width)
        values = critic(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids)  # [1, L]
        return packed.scatter(values[0, packed.predictors].float(), batch_size, response_width)
    mask = attention_mask[:, :-1]
    values = critic(input_ids=input_ids[:, :-1], attention_mask=mask, position_ids=positions_from_mask(mask))
    values = values[:, prompt_len - 1 :].float()  # [B, T]: positions P-1 .. S-2
    return torch.where(attention_mask[:, prompt_len:].bool(), values, 0.0)
