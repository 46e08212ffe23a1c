"""Chat templates in the shape of the published ones of the families in pyllama.server.tool_formats
(Qwen3-Coder): how tools are listed, how an assistant's calls and a
tool's results are shown, the generation prompt."""
from __future__ import annotations

# Qwen3-Coder: ChatML turns, tools listed as XML, calls as <function=...> with one tag per
# parameter (strings bare, other values as JSON), results in a user turn in <tool_response>.
QWEN3_CODER = """{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if system_message is defined %}{{- system_message + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n<function>\\n<name>' + tool.function.name + '</name>' }}
{%- if tool.function.description is defined %}
{{- '\\n<description>' + tool.function.description + '</description>' }}
{%- endif %}
{{- '\\n<parameters>' }}
{%- for pname, pfields in (tool.function.parameters.properties or {}) | items %}
{{- '\\n<parameter>\\n<name>' + pname + '</name>\\n' + (pfields | tojson) + '\\n</parameter>' }}
{%- endfor %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n' }}
{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n' }}
{{- '</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif system_message is defined %}
{{- '<|im_start|>system\\n' + system_message + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}{% if message.content %}{{- message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for args_name, args_value in tool_call.arguments | items %}
{{- '<parameter=' + args_name + '>\\n' }}
{{- args_value if args_value is string else args_value | tojson }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}"""

TEMPLATES = {"qwen3_coder": QWEN3_CODER}
