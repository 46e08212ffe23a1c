"""Chat templates in the shape of each tool-call family's published ones (the parts that matter:
how tools are listed, how an assistant's calls and a tool's results are shown, the generation
prompt), written for the tests of tool calls and reasoning."""
from __future__ import annotations

# Hermes 2 Pro / Qwen 2.5: tools in the system turn, calls in <tool_call> tags, results in a user
# turn inside <tool_response> tags.
HERMES = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\n<tools>' }}{% for tool in tools %}{{- '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content }}
{%- for tc in message.tool_calls or [] %}
{{- '<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}"""

# Qwen3: the Hermes layout of calls, with a thinking: an assistant's reasoning_content shown between
# <think> tags before its content, and an empty thinking closed in the generation prompt when
# enable_thinking is false. The template llama-server (and pyllama) reads thinking under; HERMES,
# which shows no reasoning, is read as content only.
QWEN3 = HERMES.replace(
    "{{- '<|im_start|>assistant\\n' + message.content }}",
    "{{- '<|im_start|>assistant\\n' }}{% if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}{% endif %}"
    "{{- message.content }}")

# Llama 3.1 / 3.2: "Environment: ipython", calls as {"name", "parameters"}, results in ipython turns.
LLAMA3 = """{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\n' }}
{%- for t in tools %}{{- (t | tojson) + '\\n' }}{% endfor %}
{{- 'Reply with {\"name\": function name, \"parameters\": arguments} to call a function.<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- for tc in message.tool_calls %}
{{- '{"name": "' + tc.function.name + '", "parameters": ' + (tc.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

# Mistral Nemo: [AVAILABLE_TOOLS], [TOOL_CALLS] with 9-character ids (refused otherwise), [TOOL_RESULTS].
MISTRAL = """{{- bos_token }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS][' }}
{%- for tc in message.tool_calls %}
{%- if tc.id is not defined or tc.id | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + ', "id": "' + tc.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{% endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]{"call_id": "' + message.tool_call_id + '", "content": ' + (message.content | tojson) + '}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# DeepSeek R1: calls in <｜tool▁calls▁begin｜> blocks with arguments as text (each written with
# the expressions of the published template, which llama-server recognises), results in
# <｜tool▁outputs▁begin｜>, earlier thinking cut from the history, and a generation prompt that
# opens the thinking.
DEEPSEEK = """{{- bos_token }}
{%- set ns = namespace(is_first=false) %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{{- message['content'] }}
{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{%- set ns.is_first = false %}
{%- for tool in message['tool_calls'] %}
{%- if not ns.is_first -%}
{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}
{%- set ns.is_first = true %}
{%- else %}
{{- '\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}
{%- endif %}
{%- endfor %}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- elif message['role'] == 'assistant' %}
{%- set content = message['content'] %}
{%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
{%- elif message['role'] == 'tool' %}
{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{% endif %}"""

# A template that knows nothing of tools (Gemma-like): the generic format.
GENERIC = """{%- for message in messages %}
{{- '<start_of_turn>' + message.role + '\\n' + message.content + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{% endif %}"""

FAMILY_TEMPLATES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "deepseek": DEEPSEEK, "generic": GENERIC}
