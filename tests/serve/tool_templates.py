"""Chat templates of the tool-calling families, cut to what they write for a conversation with
tools: the assistant turn that calls tools is written as in the checkpoints' own templates
(Meta's Llama 3.1, Mistral-7B-Instruct-v0.3, Mistral Small 3.2, Qwen2.5, DeepSeek-V3 and
V3.1), so a parser reading it back reads what those models were trained to write."""
from __future__ import annotations

LLAMA31 = """{{- bos_token }}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ \
message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}\
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL_V03 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- endif %}
{%- endfor %}
"""

MISTRAL_ARGS = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message.get('tool_calls') %}
            {%- for tool_call in message.tool_calls %}
                {{- '[TOOL_CALLS]' + tool_call.function.name }}
                {{- '[ARGS]' + tool_call['function']['arguments']|tojson }}
            {%- endfor %}
            {{- eos_token }}
        {%- else %}
            {{- message['content'] + eos_token }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""

QWEN25 = """{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}\
{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

DEEPSEEK_V3 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content']}}{%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' in message %}
        {%- set ns = namespace(is_first=false) %}
        {%- for tool in message['tool_calls'] %}
            {%- if not ns.is_first %}
                {{- '<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + \
'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + \
tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}
                {%- set ns.is_first = true -%}
            {%- else %}
                {{- '\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + \
tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + \
'\\n' + '```' + '<｜tool▁call▁end｜>'}}
            {%- endif %}
        {%- endfor %}
        {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
    {%- endif %}
{%- endfor -%}
{% if add_generation_prompt %}{{- '<｜Assistant｜>'}}{% endif %}
"""

DEEPSEEK_V31 = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content']}}{%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' in message %}
        {{- '<｜Assistant｜></think><｜tool▁calls▁begin｜>'}}
        {%- for tool in message['tool_calls'] %}
            {{- '<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + \
tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
        {%- endfor %}
        {{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
    {%- endif %}
{%- endfor -%}
{% if add_generation_prompt %}{{- '<｜Assistant｜></think>'}}{% endif %}
"""

# Each family's template, what its assistant turn ends with, and whether its template takes
# the arguments as a mapping (Jinja's tojson) or as the JSON string OpenAI clients send.
FAMILIES = {
    "llama3_json": (LLAMA31, "<|eot_id|>", True),
    "mistral": (MISTRAL_V03, "</s>", True),
    "mistral_args": (MISTRAL_ARGS, "</s>", True),
    "hermes": (QWEN25, "<|im_end|>\n", True),
    "deepseek_v3": (DEEPSEEK_V3, "<｜end▁of▁sentence｜>", False),
    "deepseek_v31": (DEEPSEEK_V31, "<｜end▁of▁sentence｜>", False),
}
