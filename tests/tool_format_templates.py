"""Chat templates in the shape of the published ones of the families in pyllama.server.tool_formats
(Qwen3-Coder, GLM 4.5, Kimi K2, gpt-oss): how tools are listed, how an assistant's calls and a
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

# Qwen3.5 / Nemotron Nano 3: Qwen3-Coder's calls with a thinking, which the generation prompt
# opens (closed at once when enable_thinking is false). llama-server reads thinking under the
# Qwen3-Coder format only where the template has <think>: QWEN3_CODER's replies are content only.
QWEN35 = QWEN3_CODER.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{% endif %}{% endif %}")

# GLM 4.5: [gMASK]<sop>, tools as JSON lines, calls as <tool_call>NAME with <arg_key>/<arg_value>
# pairs, results in an <|observation|> turn, thinking in <think> tags.
GLM45 = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for m in messages %}
{%- if m.role == 'system' %}<|system|>
{{ m.content }}
{%- elif m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{%- if m.reasoning_content %}
<think>{{ m.reasoning_content }}</think>
{%- else %}
<think></think>
{%- endif %}
{%- if m.content %}
{{ m.content.strip() }}
{%- endif %}
{%- for tc in m.tool_calls or [] %}
{%- if tc.function %}{%- set tc = tc.function %}{%- endif %}
<tool_call>{{ tc.name }}
{% for k, v in tc.arguments | items %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{%- if enable_thinking is defined and not enable_thinking %}
<think></think>
{%- endif %}
{%- endif %}"""

# Kimi K2: <|im_...|> turns, tools declared as JSON, calls in a section with ids functions.NAME:IDX.
KIMI_K2 = """{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>
{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>
{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>
{%- else -%}<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{ message.content or '' }}<|tool_calls_section_begin|>
{%- for tool_call in message.tool_calls -%}
<|tool_call_begin|>{{ tool_call.id }}<|tool_call_argument_begin|>
{%- if tool_call.function.arguments is string %}{{ tool_call.function.arguments }}
{%- else %}{{ tool_call.function.arguments | tojson }}{% endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message.role == 'tool' -%}
## Return of {{ message.tool_call_id }}
{{ message.content }}
{%- else -%}
{{ message.content }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

# gpt-oss (harmony): system and developer messages, tools as a TypeScript-like namespace, calls on
# the commentary channel addressed to=functions.NAME, results from functions.NAME to=assistant.
GPT_OSS = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for t in tools %}
// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'system' %}<|start|>developer<|message|># Instructions

{{ message.content }}<|end|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- if message.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}
{%- set tc = message.tool_calls[0].function %}
{{- '<|start|>assistant to=functions.' + tc.name + '<|channel|>commentary json<|message|>' }}
{{- tc.arguments if tc.arguments is string else tc.arguments | tojson }}<|call|>
{%- elif message.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
{%- elif message.role == 'tool' %}
{%- set prev = messages[loop.index0 - 1] if loop.index0 > 0 else {} %}
{%- set caller = prev.tool_calls[0].function.name if prev.tool_calls else 'tool' %}
{{- '<|start|>functions.' + caller + ' to=assistant<|channel|>commentary<|message|>' }}
{{- (message.content | tojson) + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

TEMPLATES = {"qwen3_coder": QWEN3_CODER, "glm45": GLM45, "kimi_k2": KIMI_K2, "harmony": GPT_OSS}
