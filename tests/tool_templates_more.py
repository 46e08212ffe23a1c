"""Chat templates in the shape of the published ones of the formats in tool_formats_more.py (the
parts that matter: the markers that identify them, how tools are listed, how an assistant's calls
and a tool's results are shown, the generation prompt), written for the tests."""
from __future__ import annotations

# Functionary v3.2: a recipient line after ">>>" before every part, the prompt ends with ">>>".
FUNCTIONARY_V32 = """{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou are capable of executing available function(s) if required.\\n'
    + 'Reply as >>>${recipient}\\n${content}; >>>all\\n is for the user.\\n'
    + '// Supported function definitions that should be called when necessary.\\nnamespace functions {\\n' }}
{%- for t in tools %}{{- '// ' + (t.function.description or '') + '\\ntype ' + t.function.name + ' = (_: '
    + (t.function.parameters | tojson) + ') => any;\\n' }}{% endfor %}
{{- '} // namespace functions<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- if message.content %}{{- '>>>all\\n' + message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}
{{- '>>>' + tc.function.name + '\\n' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n>>>' }}{% endif %}"""

# Functionary v3.1 (Llama 3.1 style): <function=NAME>{...}</function>, results in ipython turns.
FUNCTIONARY_V31 = """{{- bos_token }}
{%- set has_code_interpreter = tools | selectattr("type", "equalto", "code_interpreter") | list | length > 0 -%}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\nYou have access to the following functions:\\n\\n' }}
{%- for t in tools %}{{- 'Use the function \\'' + t.function.name + '\\' to: ' + (t.function.description or '') + '\\n'
    + (t.function | tojson) + '\\n\\n' }}{% endfor %}
{{- 'Think very carefully before calling functions.\\nIf you choose to call a function ONLY reply in the following format:\\n'
    + '<function=example_function_name>{"example_name": "example_value"}</function><|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + (message.content or '') }}
{%- for tc in message.tool_calls or [] %}
{{- '<function=' + tc.function.name + '>' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '</function>' }}
{%- endfor %}
{{- '<|eom_id|>' if message.tool_calls else '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""

# Command R7B: thinking (shown before an assistant's actions), actions as a JSON list, results as a
# JSON list, replies wrapped.
COMMAND_R7B = """{{- bos_token }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble
You may use tools. Write <|START_THINKING|>your plan<|END_THINKING|>, then <|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|> or <|START_RESPONSE|>your reply<|END_RESPONSE|>.
{%- if tools %}
## Available Tools
```json
[{% for t in tools %}{{ t.function | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]
```
{%- endif %}<|END_OF_TURN_TOKEN|>
{%- for message in messages %}
{%- if message.role == 'user' or message.role == 'system' %}
{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + message.content + '<|END_OF_TURN_TOKEN|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}
{%- if message.tool_calls %}
{{- '<|START_THINKING|>' + (message.reasoning_content or '') + '<|END_THINKING|><|START_ACTION|>[' }}
{%- for tc in message.tool_calls %}
{{- '{"tool_call_id": "' + tc.id + '", "tool_name": "' + tc.function.name + '", "parameters": ' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '}' }}{% if not loop.last %}{{ ', ' }}{% endif %}
{%- endfor %}
{{- ']<|END_ACTION|>' }}
{%- else %}
{{- '<|START_RESPONSE|>' + message.content + '<|END_RESPONSE|>' }}
{%- endif %}
{{- '<|END_OF_TURN_TOKEN|>' }}
{%- elif message.role == 'tool' %}
{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[{"tool_call_id": "' + message.tool_call_id + '", "results": {"0": ' + (message.content | tojson) + '}}]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"""

# Granite 3.3: tools in an available_tools turn, calls after <|tool_call|>, thinking mode with
# <think> and <response>.
GRANITE = """{%- if tools %}
{{- '<|start_of_role|>available_tools<|end_of_role|>' }}{% for t in tools %}{{ t | tojson(indent=4) }}{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}{{ '<|end_of_text|>\\n' }}
{%- endif %}
{%- if thinking is defined and thinking %}
{{- '<|start_of_role|>system<|end_of_role|>You are a helpful AI assistant. Respond to every user query in a comprehensive and detailed way. You can write down your thoughts and reasoning process before responding. In the thought process, engage in a comprehensive cycle of analysis, summarization, exploration, reassessment, reflection, backtracing, and iteration to develop well-considered thinking process. In the response section, based on various attempts, explorations, and reflections from the thoughts section, systematically present the final solution that you deem correct. The response should summarize the thought process. Write your thoughts between <think></think> and write your response between <response></response> for each user query.<|end_of_text|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' }}[{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{{ '<|end_of_text|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|start_of_role|>tool_response<|end_of_role|>' + message.content + '<|end_of_text|>\\n' }}
{%- else %}
{{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + (message.content or '') + '<|end_of_text|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"""

# Magistral: a system prompt, [THINK] reasoning, one [TOOL_CALLS]NAME[ARGS]{...} per call.
MAGISTRAL = """{{- bos_token }}
{{- '[SYSTEM_PROMPT]First draft your thinking process between [THINK] and [/THINK], then reply.[/SYSTEM_PROMPT]' }}
{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '[INST]' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}
{{- message.content or '' }}
{%- for tc in message.tool_calls or [] %}
{{- '[TOOL_CALLS]' + tc.function.name + '[ARGS]' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) }}
{%- endfor %}
{{- eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]' + message.content + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# Seed-OSS: <seed:bos>role ... <seed:eos>, XML-like calls in <seed:tool_call>, <seed:think> thinking
# (an assistant's shown again).
SEED_OSS = """{%- if tools %}
{{- '<seed:bos>system\\nYou may call these functions:\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}
{{- 'Call one as <seed:tool_call>\\n<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>\\n</seed:tool_call><seed:eos>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<seed:bos>assistant\\n' }}
{%- if message.reasoning_content %}{{ '<seed:think>' + message.reasoning_content | trim + '</seed:think>' }}{% endif %}
{{- message.content or '' }}
{%- for tc in message.tool_calls or [] %}
{{- '<seed:tool_call>\\n<function=' + tc.function.name + '>\\n' }}
{%- if tc.function.arguments is mapping %}
{%- for k, v in tc.function.arguments.items() %}{{ '<parameter=' + k + '>' + (v if v is string else v | tojson) + '</parameter>\\n' }}{% endfor %}
{%- else %}{{ tc.function.arguments }}
{%- endif %}
{{- '</function>\\n</seed:tool_call>' }}
{%- endfor %}
{{- '<seed:eos>' }}
{%- elif message.role == 'tool' %}
{{- '<seed:bos>tool\\n' + message.content + '<seed:eos>' }}
{%- else %}
{{- '<seed:bos>' + message.role + '\\n' + message.content + '<seed:eos>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<seed:bos>assistant\\n' }}{% endif %}"""

# Apertus: inner thoughts between <|inner_prefix|> and <|inner_suffix|>, calls as [{NAME: ARGS}].
APERTUS = """{{- bos_token }}
{{- '<|system_start|>You are Apertus.' }}
{%- if tools %}{{- '\\n\\n### Tools\\n\\nCall them as <|tools_prefix|>[{"name": {arguments}}]<|tools_suffix|>.\\n' }}{% for t in tools %}{{ t.function | tojson }}{{ '\\n' }}{% endfor %}{% endif %}
{{- '<|system_end|>' }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|user_start|>' + message.content + '<|user_end|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|assistant_start|>' }}{% if message.reasoning_content %}{{- '<|inner_prefix|>' + message.reasoning_content + '<|inner_suffix|>' }}{% endif %}
{{- message.content or '' }}
{%- if message.tool_calls %}
{{- '<|tools_prefix|>[' }}{% for tc in message.tool_calls %}{{ '{"' + tc.function.name + '": ' + (tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson) + '}' }}{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ ']<|tools_suffix|>' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{{- '[' + (message.content | tojson) + ']<|assistant_end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant_start|>' }}{% endif %}"""

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
    "functionary-v3.2": FUNCTIONARY_V32,
    "functionary-v3.1": FUNCTIONARY_V31,
    "command-r7b": COMMAND_R7B,
    "granite": GRANITE,
    "magistral": MAGISTRAL,
    "seed-oss": SEED_OSS,
    "apertus": APERTUS,
    "nemotron-v2": NEMOTRON_V2,
}
