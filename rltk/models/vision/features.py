"""Image features computed once per RL step and reused by every forward of that step, for a frozen tower.

One RL step runs a VLM over the same images several times: the rollout's prefill, the old-policy pass, the
reference pass and the update's forward (once per epoch), each cutting its own micro-batches. With the vision
tower frozen (``model.freeze_vision_tower``, the default) its features are a function of the pixels alone, so
:class:`ImageFeatureCache` computes each image's once and hands them back to every later forward: the
model's own ``get_image_features`` (which runs the tower and its merger) is wrapped, for the span of a step,
by one that looks each image up by its pixels and grid and runs the tower only on the images it has not
seen. The language model then places the features as it would have (``masked_scatter`` at the placeholder
tokens), so log-probs and gradients are those of the uncached forward up to float rounding: a Qwen-VL tower
attends within each image (its ``cu_seqlens``), so an image's features do not depend on which other images
share its forward.

A tower that trains (``model.freeze_vision_tower=false``) is never cached: its features change with every
optimizer step and carry gradients. Each module caches for itself (the policy and a reference copy each run
their tower once per step): a copy's tower is another module, and whether its weights equal the policy's is
not assumed.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterable, Iterator

import torch
from torch import nn

from rltk.models.vision.tower import vision_tower


def tower_owner(model: nn.Module) -> nn.Module | None:
    """The module whose ``get_image_features`` runs ``model``'s vision tower (Qwen-VL: the inner
    ``Qwen2_5_VLModel``), or None for a text model."""
    tower = vision_tower(model)
    if tower is None:
        return None
    for module in model.modules():
        if getattr(module, "visual", None) is tower and callable(getattr(module, "get_image_features", None)):
            return module
    return None


def is_frozen(model: nn.Module) -> bool:
    """Whether ``model`` has a vision tower none of whose parameters train (LoRA adapters on it included)."""
    tower = vision_tower(model)
    return tower is not None and not any(p.requires_grad for p in tower.parameters())


def _image_key(pixels: torch.Tensor, grid: torch.Tensor) -> tuple:
    """An image's identity: its grid and a digest of its patch values (bytes, so equal pixels give equal keys)."""
    digest = hashlib.blake2b(pixels.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=16)
    return tuple(grid.tolist()), digest.hexdigest()


class ImageFeatureCache:
    """Each image's merged features (``[tokens, hidden]``), computed once while :meth:`serving` is open.

    Attributes:
        computed: images the tower ran on since the cache was made.
        reused: images served from the cache instead.
    """

    def __init__(self) -> None:
        self._features: dict[tuple, torch.Tensor] = {}
        self.computed = 0
        self.reused = 0

    def clear(self) -> None:
        """Forget every image (the next step's weights or images may differ)."""
        self._features.clear()

    @contextlib.contextmanager
    def serving(self, models: Iterable[nn.Module]) -> Iterator["ImageFeatureCache"]:
        """Wrap the ``get_image_features`` of each of ``models`` that has a frozen tower; restore them after.

        Modules without a tower, or with one that trains, run as they are. The features are kept until
        :meth:`clear` or the end of the ``with`` block, whichever comes first.
        """
        patched: list[nn.Module] = []
        try:
            for model in models:
                owner = tower_owner(model) if isinstance(model, nn.Module) else None
                if owner is None or not is_frozen(model) or "get_image_features" in vars(owner):
                    continue
                owner.get_image_features = self._wrap(owner, owner.get_image_features)
                patched.append(owner)
            yield self
        finally:
            for owner in patched:
                del owner.get_image_features  # the class's method again
            self.clear()

    def _wrap(self, owner: nn.Module, compute):
        scope = id(owner)  # one module's features are never served to another

        def get_image_features(pixel_values, image_grid_thw=None, **kwargs):
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            pieces = torch.split(pixel_values, image_grid_thw.prod(-1).tolist())
            keys = [(scope, *_image_key(pixels, grid)) for pixels, grid in zip(pieces, image_grid_thw)]
            missing: dict[tuple, int] = {}  # each image not seen yet, once (the n samples of a prompt share it)
            for index, key in enumerate(keys):
                if key not in self._features:
                    missing.setdefault(key, index)
            if missing:
                order = list(missing.values())
                with torch.no_grad():  # a frozen tower: its features carry no gradient anyway
                    out = compute(torch.cat([pieces[i] for i in order]), image_grid_thw[order], **kwargs)
                for key, features in zip(missing, out.pooler_output):
                    self._features[key] = features.detach()
            self.computed += len(missing)
            self.reused += len(keys) - len(missing)
            return BaseModelOutputWithPooling(pooler_output=tuple(self._features[key] for key in keys))

        return get_image_features
