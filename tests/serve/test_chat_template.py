"""Chat templates: found where transformers saves them, rendered as transformers renders them."""

from __future__ import annotations

import json

import pytest

from ortpa.errors import InvalidModel
from ortpa.serve.chat import TemplateRenderError, load_chat_template

# a realistic template (Llama-3 style): whitespace control, loop variables, a namespace, tojson, raise_exception
LLAMA3 = (
    "{{- bos_token }}\n{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}{%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
    "{#- meta: {{ messages | tojson }} -#}\n"
)
MESSAGES = [
    {"role": "system", "content": "Réponds brièvement."},
    {"role": "user", "content": " hello  "},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "world"},
]


def _folder(tmp_path, config=None, jinja=None):
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_renders_like_transformers(tmp_path, model_folder):
    """Against transformers' own apply_chat_template on the same tokenizer and template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(model_folder / "tokenizer.json"), bos_token="<s>", eos_token="</s>", chat_template=LLAMA3
    )
    template = load_chat_template(_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA3}))
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert template.render(MESSAGES, add_generation_prompt=add) == expected


def test_where_the_template_comes_from(tmp_path):
    assert load_chat_template(tmp_path) is None  # nothing there
    assert load_chat_template(_folder(tmp_path, {"bos_token": "<s>"})) is None  # a config without a template
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]
    assert (
        load_chat_template(_folder(tmp_path, {"bos_token": {"content": "<s>"}, "chat_template": named})).render([])
        == "<s>D"
    )
    # transformers 5 saves chat_template.jinja; it wins over the config's key
    assert load_chat_template(_folder(tmp_path, jinja="J{{ eos_token }}")).render([]) == "J"  # no eos_token: empty


def test_bad_templates(tmp_path):
    with pytest.raises(InvalidModel, match="does not parse"):
        load_chat_template(_folder(tmp_path, {"chat_template": "{% for m in messages %}"}))
    template = load_chat_template(_folder(tmp_path, {"chat_template": LLAMA3}))
    with pytest.raises(TemplateRenderError, match="unknown role: tool"):
        template.render([{"role": "tool", "content": "x"}])
    sandboxed = load_chat_template(_folder(tmp_path, {"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(TemplateRenderError):
        sandboxed.render([])
