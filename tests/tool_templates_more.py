"""Chat templates in the shape of the published ones of the formats in tool_formats_more.py (the
parts that matter: the markers that identify them, how tools are listed, how an assistant's calls
and a tool's results are shown, the generation prompt), written for the tests."""
from __future__ import annotations

# Nemotron Nano v2: <SPECIAL_1x> turns, <TOOLCALL>[...]</TOOLCALL>, results in <TOOL_RESPONSE>.
NEMOTRON_V2 = """{{- '<SPECIAL_10>System\\n' }}
{%- if tools %}{{- 'You can use the following tools in the <AVAILABLE_TOOLS> tags:\\n<AVAILABLE_TOOLS>[' }}{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}{{ ']</AVAILABLE_TOOLS>\\nCall them as <TOOLCALL>[{"name": "...", "arguments": {...}}]</TOOLCALL>\\n' }}{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<SPECIAL_11>User\\n' + message.content + '\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<SPECIAL_11>Assistant\\n' + (message.content or '') }}
{%- if message.tool_calls %}
{{- '<TOOLCALL>[' }}{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}{{ ']</TOOLCALL>' }}
{%- endif %}
{{- '\\n<SPECIAL_12>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<SPECIAL_11>User\\n<TOOL_RESPONSE>[' + message.content + ']</TOOL_RESPONSE>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<SPECIAL_11>Assistant\\n<think>\\n' }}{% endif %}"""

MORE_TEMPLATES = {
    "nemotron-v2": NEMOTRON_V2,
}
