"""``rltk new plugin NAME --kind KIND``: write an installable plugin package whose own tests pass as written.

The package (``rltk-plugin-<name>/``) holds a pyproject with the one entry point rltk finds plugins by, a
component of the chosen kind with its formula in the docstring and a check of its arguments, a test on a
number worked out by hand, and a short README. ``pip install -e rltk-plugin-<name>`` and ``rltk list KIND``
shows it; ``cd rltk-plugin-<name> && python -m pytest`` runs its test. The component is a worked example
to replace with your own: the test says what to keep true when you do.
"""

from __future__ import annotations

import re
from pathlib import Path

from rltk.errors import ConfigError

NAME = re.compile(r"[a-z][a-z0-9_]{0,40}")

#: kind -> (hook, what the component is, its source, its test's body, extra dependencies)
TEMPLATES: dict[str, tuple[str, str, str, str, list[str]]] = {
    "advantage_fn": (
        "rltk_advantage_fns",
        "an advantage estimator",
        '''def {name}(
    *, scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, scale: float = 1.0
):
    """Group-mean baseline: each response's score minus its group's mean score, scaled.

        A_i = scale * (s_i - mean_{{j : g_j = g_i}} s_j)        on every response token of i

    (REINFORCE with a per-prompt mean baseline, as in GRPO without the division by the group's std; a
    group of one gets 0). Returns are the advantages.

    Shape: scores (B,), group_ids (B,), response_mask (B, T) -> advantages, returns (B, T).
    """
    same_group = (group_ids[:, None] == group_ids[None, :]).float()  # [B, B]
    baseline = same_group @ scores.float() / same_group.sum(1)  # [B]
    advantages = scale * (scores.float() - baseline)[:, None] * response_mask  # [B, T]
    return advantages, advantages.clone()


def check_args(args: dict) -> None:
    """Refuse a scale that is not a positive number (rltk calls it when the config is validated)."""
    scale = args.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"'scale' = {{scale!r}}: must be a number > 0")


{name}.check_args = check_args
''',
        '''import pytest
import torch

from {package} import {name}


def test_hand_computed_advantages():
    # groups {{1, 0}} (mean 0.5) and {{1, 1}} (mean 1): A = 2 * (s - mean) on each response token
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    advantages, returns = {name}(scores=scores, group_ids=group_ids, response_mask=mask, scale=2.0)
    assert advantages.tolist() == [[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert torch.equal(returns, advantages)


def test_a_bad_scale_is_refused():
    with pytest.raises(ValueError, match="'scale' = 0"):
        {name}.check_args({{"scale": 0}})
''',
        ["torch"],
    ),
    "reward_fn": (
        "rltk_reward_fns",
        "a reward function",
        '''def {name}(*, response: str, ground_truth: str, partial: float = 0.5, **_) -> float:
    """1 for the ground truth exactly, ``partial`` for it somewhere in the response, else 0.

        r = 1            if strip(response) == strip(ground_truth)
            partial      if strip(ground_truth) occurs in the response
            0            otherwise

    rltk passes the prompt, the row's extras and more as keywords: ``**_`` takes what this one does not use.
    """
    answer, expected = response.strip(), str(ground_truth).strip()
    if answer == expected:
        return 1.0
    return partial if expected and expected in answer else 0.0


def check_args(args: dict) -> None:
    """Refuse a partial credit outside [0, 1] (rltk calls it when the config is validated)."""
    partial = args.get("partial", 0.5)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 <= partial <= 1:
        raise ValueError(f"'partial' = {{partial!r}}: must be a number in [0, 1]")


{name}.check_args = check_args
''',
        '''import pytest

from {package} import {name}


def test_hand_computed_rewards():
    assert {name}(response=" 42\\n", ground_truth="42") == 1.0
    assert {name}(response="the answer is 42", ground_truth="42", partial=0.25) == 0.25
    assert {name}(response="41", ground_truth="42") == 0.0


def test_a_bad_partial_credit_is_refused():
    with pytest.raises(ValueError, match="'partial' = 2"):
        {name}.check_args({{"partial": 2}})
''',
        [],
    ),
    "policy_loss": (
        "rltk_policy_losses",
        "a policy loss",
        '''def {name}(
    *, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    loss_agg, ratio_cap: float = 2.0,
):
    """REINFORCE with a capped importance ratio (a truncated importance-sampling policy gradient):

        r_t = exp(log pi(y_t) - log pi_old(y_t)),      loss_t = -A_t * min(r_t, ratio_cap)

    reduced over the response tokens by ``loss_agg`` (the configured aggregation). Returns the loss and
    its metrics. Shape: every tensor (B, T).
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    capped = torch.clamp(ratio, max=ratio_cap)
    loss = loss_agg(-advantages * capped, response_mask)
    tokens = response_mask.sum().clamp(min=1)
    capped_fraction = ((ratio > ratio_cap).float() * response_mask).sum() / tokens
    return loss, {{"capped_fraction": capped_fraction.detach()}}


def check_args(args: dict) -> None:
    """Refuse a cap that is not above 1 (rltk calls it when the config is validated)."""
    cap = args.get("ratio_cap", 2.0)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 1:
        raise ValueError(f"'ratio_cap' = {{cap!r}}: must be a number > 1")


{name}.check_args = check_args
''',
        '''import math

import pytest
import torch

from {package} import {name}


def token_mean(loss_mat, mask):
    return (loss_mat * mask).sum() / mask.sum()


def test_hand_computed_loss():
    # ratios e^0 = 1 and e^1 = 2.718 (capped at 2); advantages 1 and 2: loss = -(1 * 1 + 2 * 2) / 2
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.0, 1.0]])
    loss, metrics = {name}(logprobs=new, old_logprobs=old, advantages=torch.tensor([[1.0, 2.0]]),
                           response_mask=torch.ones(1, 2), loss_agg=token_mean, ratio_cap=2.0)
    assert math.isclose(loss.item(), -2.5, rel_tol=1e-6)
    assert metrics["capped_fraction"].item() == 0.5


def test_a_cap_at_or_below_one_is_refused():
    with pytest.raises(ValueError, match="'ratio_cap' = 1"):
        {name}.check_args({{"ratio_cap": 1}})
''',
        ["torch"],
    ),
}


def add_parser(sub) -> None:
    p = sub.add_parser("new", help="write a new plugin package: rltk new plugin NAME --kind KIND")
    p.add_argument("what", choices=["plugin"], help="what to write (a plugin package)")
    p.add_argument("name", help="the component's registered name, lowercase (e.g. my_adv)")
    p.add_argument("--kind", default="advantage_fn", help=f"one of: {', '.join(TEMPLATES)} (default advantage_fn)")
    p.add_argument("--dir", default=".", help="where the package folder goes (default .)")


def cmd_new(args) -> int:
    folder = write_plugin(args.name, args.kind, Path(args.dir))
    print(f"rltk: wrote {folder}\n  pip install -e {folder}\n  rltk list {args.kind}\n  "
          f"cd {folder} && python -m pytest")
    return 0


def write_plugin(name: str, kind: str, where: Path) -> Path:
    """Write ``rltk-plugin-<name>`` under ``where``; ``ConfigError`` (exit 2) naming what is wrong."""
    if kind not in TEMPLATES:
        raise ConfigError(f"--kind {kind!r}: `rltk new plugin` writes one of {', '.join(TEMPLATES)}; for another kind "
                          f"start from one of these and see CONTRIBUTING.md's calling conventions")
    if not NAME.fullmatch(name):
        raise ConfigError(f"plugin name {name!r}: must be a lowercase Python name (letters, digits, _), "
                          f"starting with a letter, e.g. my_adv")
    hook, what, source, test, dependencies = TEMPLATES[kind]
    package = f"rltk_plugin_{name}"
    folder = where / f"rltk-plugin-{name.replace('_', '-')}"
    if folder.exists():
        raise ConfigError(f"{folder} exists already: choose another name or --dir (nothing was written)")
    deps = ", ".join(f'"{d}"' for d in ["rltk", *dependencies])
    files = {
        "pyproject.toml": f'''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "rltk-plugin-{name.replace('_', '-')}"
version = "0.1.0"
description = "An rltk plugin: {what}, `{name}`."
requires-python = ">=3.10"
dependencies = [{deps}]

# This one line is what makes rltk find the plugin.
[project.entry-points.rltk]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]

[tool.pytest.ini_options]
pythonpath = ["."]
''',
        f"{package}/__init__.py": f'"""An rltk plugin: {what}, registered as ``{name}``."""\n\n'
                                  f"from __future__ import annotations\n\n"
                                  + ("import torch\n\n" if "torch" in dependencies else "")
                                  + "import rltk\n\n\n" + source.format(name=name)
                                  + f"\n\n@rltk.hookimpl\ndef {hook}():\n    return {{\"{name}\": {name}}}\n",
        f"tests/test_{name}.py": f'"""``{name}`` on numbers worked out by hand."""\n\n' + test.format(
            name=name, package=package),
        "README.md": f"""# rltk-plugin-{name.replace('_', '-')}

{what.capitalize()} for rltk, registered as `{name}` (kind `{kind}`).

```bash
pip install -e .
rltk list {kind}            # shows {name}, from this plugin
python -m pytest            # its test, on numbers worked out by hand
```

Use it with one config entry, e.g. `rltk validate grpo {_config_key(kind, name)}`.
""",
    }
    for relative, text in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def _config_key(kind: str, name: str) -> str:
    return {"advantage_fn": f"algorithm.advantage_fn={name}", "reward_fn": f"'reward.reward_fn=[{name}]'",
            "policy_loss": f"algorithm.policy_loss={name}"}[kind]
