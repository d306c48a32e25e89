"""A DPO stage chained into another recipe's stages (``stages: [sft, dpo, grpo]``) is validated as the dpo recipe's
own: what it provides (nothing to the algorithm's components: it trains on pairs) and what its loop refuses, before
any stage runs (issue 55, item 3)."""

from __future__ import annotations

import pytest

from rltk.errors import ConfigError
from rltk.recipe_tools.validation import validate

CHAIN = "stages=[{name: warmup, type: sft}, {name: pref, type: dpo%s}, {name: rl, type: grpo}]"


def test_a_chained_dpo_stage_validates_beside_sft_and_grpo():
    _, line = validate("grpo", [], [CHAIN % ""])
    assert "3 stages: warmup (sft), pref (dpo, loss sigmoid), rl (grpo, algorithm grpo)" in line
    assert "step plan of stage 'rl' (grpo)" in line and "step plan of stage 'pref'" not in line


def test_what_the_dpo_loop_refuses_is_refused_before_the_warm_up_runs():
    bad = ", overrides: {dpo.online: true, dpo.precompute_reference: true}"
    with pytest.raises(ConfigError, match="dpo.precompute_reference=true needs fixed pairs, but dpo.online=true"):
        validate("grpo", [], [CHAIN % bad])
    with pytest.raises(ConfigError, match="dpo.precompute_reference=true needs fixed pairs"):
        validate("dpo", [], ["dpo.online=true", "dpo.precompute_reference=true"])
    with pytest.raises(ConfigError, match="unknown preference_loss 'nope' at 'dpo.loss'"):
        validate("grpo", [], [CHAIN % ", overrides: {dpo.loss: nope}"])


def test_a_stage_check_is_named_as_module_and_function():
    from rltk.registration.stage_spec import StageSpec

    with pytest.raises(ValueError, match="StageSpec check 'no_colon': name it 'package.module:function'"):
        StageSpec("a.b:c", check="no_colon")
    seen = []
    StageSpec("a.b:c", check=seen.append).check_config("cfg")
    assert seen == ["cfg"]
