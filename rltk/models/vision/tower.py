"""The vision tower of a vision-language policy: finding it and freezing it, and the rotary offsets it keeps.

``model.freeze_vision_tower`` (on by default, as verl and EasyR1 do) keeps the tower's weights, its patch
merger (the projection into the language model's width) included, as they were loaded: RL on a few
thousand prompts has too little signal to move a pretrained image encoder usefully, and a frozen tower
needs no gradients or optimizer state.
"""

from __future__ import annotations

from torch import nn

#: Attribute names under which transformers' VLMs keep their vision tower (Qwen2-VL to Qwen3-VL: ``visual``).
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision tower of ``model`` (a VLM, possibly wrapped by peft or a strategy), or None for a text model."""
    seen: set[int] = set()
    pending = [model]
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name in VISION_TOWER_NAMES:
            tower = getattr(module, name, None)
            if isinstance(tower, nn.Module):
                return tower
        pending.extend(child for name, child in module.named_children()
                       if name in ("model", "module", "base_model", "_orig_mod"))
    return None


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients through ``model``'s vision tower; returns how many parameters were frozen (0: no tower)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def forget_rope_deltas(model: nn.Module) -> bool:
    """Clear the 3-D rotary offsets a Qwen-VL model keeps from its last forward; True where it keeps them.

    Qwen2.5-VL and Qwen3-VL store ``rope_deltas`` (one per row of the last batch) on their base model and
    ``generate`` reuses them for the next call's positions: a batch of another size (the next rollout,
    an evaluation, a prefill over distinct prompts) fails, or worse, gets another batch's offsets.
    """
    kept = False
    for module in model.modules():
        if hasattr(module, "rope_deltas"):
            module.rope_deltas = None
            kept = True
    return kept


#: Config keys of the tokens that stand for images and videos (placeholders and their markers).
VISION_TOKEN_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model: nn.Module) -> list[int]:
    """The ids of ``model``'s image and video tokens (none for a text model).

    A response must never hold one: the next forward would look for image features for it (and fail, or
    take another image's). The hf engine gives them probability 0 when it samples from a VLM.
    """
    from rltk.models.wrappers import unwrap_model

    config = getattr(unwrap_model(model), "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return []
    return sorted({value for key in VISION_TOKEN_ID_KEYS if isinstance(value := getattr(config, key, None), int)})
