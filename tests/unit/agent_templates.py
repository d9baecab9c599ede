"""Chat templates written for the agents tests from the published formats (not copied from any
checkpoint): a Qwen-style one (hermes calls), a LLaDA2 / Ling-2.0-style one and a Gemma 4-style one
(DiffusionGemma: turns, thinking channel, `<|tool_call>call:NAME{...}<tool_call|>`)."""

from __future__ import annotations

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    "Return calls as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- if not loop.first or m.content %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

LLADA2_STYLE = (
    "<role>SYSTEM</role>{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "{%- if tools %}# Tools\n<tools>{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    "For each function call, return <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call>\n{% endif %}detailed thinking off<|role_end|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<role>HUMAN</role>{{ m.content }}<|role_end|>"
    "{%- elif m.role == 'assistant' %}<role>ASSISTANT</role>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- if not loop.first or m.content %}\n{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|role_end|>"
    "{%- elif m.role == 'tool' %}{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<role>OBSERVATION</role>{%- endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|role_end|>{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<role>ASSISTANT</role>{%- endif %}"
)

# Gemma 4-style: values in the call syntax (bare keys, <|"|> strings) by a recursive macro.
GEMMA_STYLE = (
    "{%- macro gv(v) -%}"
    "{%- if v is string -%}<|\"|>{{ v }}<|\"|>"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v.items() -%}{{ k }}:{{ gv(x) }}"
    "{%- if not loop.last %},{% endif -%}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sameas true -%}true{%- elif v is sameas false -%}false{%- elif v is none -%}null"
    "{%- elif v is iterable -%}[{%- for x in v -%}{{ gv(x) }}{%- if not loop.last %},{% endif -%}{%- endfor -%}]"
    "{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}{%- if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:{{ t.function.name }}"
    "{{ gv(t.function.parameters) }}<tool|>{%- endfor %}<turn|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|tool_response>response:{{ m.name }}{{ '{' }}value:<|\"|>{{ m.content }}<|\"|>"
    "{{ '}' }}<tool_response|>"
    "{%- elif m.role == 'assistant' %}<|turn>model\n"
    "{%- if m.reasoning_content %}<|channel>thought\n{{ m.reasoning_content }}<channel|>{% endif %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ gv(c.function.arguments) }}"
    "<tool_call|>{%- endfor %}{%- if not m.tool_calls %}<turn|>\n{% endif %}"
    "{%- else %}<|turn>{{ 'user' if m.role == 'user' else m.role }}\n{{ m.content }}<turn|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|turn>model\n{% endif %}"
)
