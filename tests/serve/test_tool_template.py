"""Tools through a real tool-calling template (Qwen 2.5's form, condensed): rendered as transformers renders it,
from the messages an OpenAI client sends (call arguments as JSON text), and recognised as taking tools."""

from __future__ import annotations

import json

from ortpa.serve.chat import ChatTemplate
from ortpa.serve.tool_requests import template_messages

QWEN = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\n<tools>" }}\n'
    '    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nReturn <tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <args>}\\n</tool_call>'
    '<|im_end|>\\n" }}\n'
    "{%- elif messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
OPENAI_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_tools_render_as_transformers_renders_them(model_folder):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_folder / "tokenizer.json"), chat_template=QWEN)
    # what transformers documents: the call's arguments as an object
    hf_messages = json.loads(json.dumps(OPENAI_MESSAGES))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    expected = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate(QWEN).render(template_messages(OPENAI_MESSAGES), add_generation_prompt=True, tools=TOOLS)
    assert got == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in got  # not a JSON-in-JSON string
    assert '"description": "Météo d\'une ville"' in got  # tojson keeps non-ASCII text, as transformers' does
    # without tools the template takes its other branch, as transformers' does
    plain = [OPENAI_MESSAGES[0]]
    assert ChatTemplate(QWEN).render(plain) == hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)


def test_which_templates_take_tools():
    from serve.structured_fixtures import TOOL_TEMPLATE
    from serve.test_chat_template import LLAMA3

    assert ChatTemplate(QWEN).supports_tools and ChatTemplate(QWEN).tool_call_tags
    assert ChatTemplate(TOOL_TEMPLATE).supports_tools
    assert not ChatTemplate(LLAMA3).supports_tools
    # a template that only mentions the word in text does not read the variable
    assert not ChatTemplate("{{ 'no tools here' }}{% for m in messages %}{{ m.content }}{% endfor %}").supports_tools
