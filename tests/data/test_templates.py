"""Prompt templates name plain fields only: no attribute access, indexing, conversions or format specs."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rltk.config import load_config
from rltk.data.loading import format_prompts
from rltk.data.synthetic import countdown
from rltk.data.templates import fill_template, template_fields
from rltk.errors import ConfigError
from rltk.models.tiny import build_char_tokenizer

KEY = "data.prompt_template"
ROWS = [{"prompt": "17+25=", "ground_truth": "42", "extras": {"level": 1, "meta": {"secret": "s3"}}, "id": "a"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("template, why", [
    ("{prompt.__class__.__mro__}", "attribute access and indexing are not allowed"),
    ("{prompt.__class__}", "attribute access and indexing are not allowed"),
    ("{meta[secret]}", "attribute access and indexing are not allowed"),
    ("{}", "positional fields are not allowed"),
    ("{0}", "positional fields are not allowed"),
    ("{ prompt}", "' prompt' is not a field name"),
    ("{prompt!r}", "conversions and format specs are not allowed; write it as {prompt}"),
    ("{prompt:>99999999}", "conversions and format specs are not allowed"),
    ("{prompt:{level.__class__}}", "conversions and format specs are not allowed"),
])
def test_only_plain_field_names_are_allowed(tokenizer, template, why):
    with pytest.raises(ValueError, match="^" + re.escape(f"{KEY}={template!r} has the field")):
        template_fields(template, KEY)
    with pytest.raises(ValueError) as info:
        format_prompts(ROWS, tokenizer, prompt_template=template)
    assert why in str(info.value) and KEY in str(info.value)
    # str.format would have evaluated it (the hole this closes), where it does not need a missing field.
    if template.startswith("{prompt.") or template.startswith("{meta["):
        assert template.format(prompt="x", meta={"secret": "s3"})


def test_a_bad_template_is_a_config_error_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('data:\n  prompt_template: "Q: {prompt.__class__}"\n')
    with pytest.raises(ConfigError, match=r"data\.prompt_template='Q: \{prompt\.__class__\}' has the field "
                                          r"\{prompt\.__class__\}: attribute access"):
        load_config([bad], [])
    good = tmp_path / "good.yaml"
    good.write_text('data:\n  prompt_template: "Q: {prompt} {{literal}}"\n')
    assert load_config([good], []).data.prompt_template == "Q: {prompt} {{literal}}"


def test_fields_fill_in_order_and_literal_braces_stay(tokenizer):
    assert template_fields("L{level}: {prompt} {{x}}", KEY) == ["level", "prompt"]
    out = format_prompts(ROWS, tokenizer, prompt_template="L{level}: {prompt} {{x}}")
    assert out[0]["prompt"] == "L1: 17+25= {x}"
    # A dict-valued extra is only ever str()-ed, never indexed.
    assert fill_template("{meta}", {"meta": {"secret": "s3"}}, KEY) == "{'secret': 's3'}"


def test_missing_field_and_unbalanced_braces_name_the_key():
    with pytest.raises(ValueError, match=r"uses field 'topic' that row 'a' does not have\. Available: level, prompt"):
        fill_template("{topic}", {"level": 1, "prompt": "p"}, KEY, "row 'a'")
    with pytest.raises(ValueError, match=r"data\.prompt_template='\{prompt' is not a valid template"):
        template_fields("{prompt", KEY)
    with pytest.raises(ValueError, match=r"data\.prompt_template must be a string, got int"):
        template_fields(3, KEY)


@given(st.text(alphabet=st.characters(blacklist_characters="{}"), max_size=20),
       st.text(alphabet=st.characters(blacklist_characters="{}"), max_size=20))
def test_plain_templates_fill_like_str_format(before, after):
    template = before + "{prompt}" + after + "{level}"
    fields = {"prompt": "p{x}", "level": 3}
    assert fill_template(template, fields, KEY) == template.format(**fields)


def test_countdown_task_template_names_plain_fields_only():
    rows = countdown("train", 2, 0, prompt_template="Reach {target} with {numbers}.")
    assert rows[0]["prompt"] == f"Reach {rows[0]['extras']['target']} with " \
        f"{' '.join(map(str, rows[0]['extras']['numbers']))}."
    with pytest.raises(ValueError, match=r"data\.task_args\.prompt_template=.*attribute access"):
        countdown("train", 2, 0, prompt_template="{target.__class__}")
