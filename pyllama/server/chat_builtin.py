"""llama-server's built-in chat templates (`--chat-template NAME`, and `--no-jinja`): each name
renders the layout llama.cpp's src/llama-chat.cpp gives it, written here as a Python formatter of
(messages, add_generation_prompt) -> prompt text. `detect` names the built-in layout a Jinja
template resembles, as llama.cpp guesses it for --no-jinja."""
from __future__ import annotations

from typing import Callable

Messages = list[dict]
Formatter = Callable[[Messages, bool], str]


def _role(m: dict) -> str:
    return str(m.get("role", ""))


def _text(m: dict) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else ""


def _strip(m: dict) -> str:
    return _text(m).strip()


def _chatml(msgs: Messages, gen: bool) -> str:
    out = "".join(f"<|im_start|>{_role(m)}\n{_text(m)}<|im_end|>\n" for m in msgs)
    return out + ("<|im_start|>assistant\n" if gen else "")


def _mistral_v7(tekken: bool) -> Formatter:
    sp = "" if tekken else " "

    def fmt(msgs: Messages, gen: bool) -> str:
        out = []
        for m in msgs:
            r, c = _role(m), _text(m)
            if r == "system":
                out.append(f"[SYSTEM_PROMPT]{sp}{c}[/SYSTEM_PROMPT]")
            elif r == "user":
                out.append(f"[INST]{sp}{c}[/INST]")
            else:
                out.append(f"{sp}{c}</s>")
        return "".join(out)
    return fmt


def _mistral(version: str) -> Formatter:
    lead = " " if version == "v1" else ""
    trail = "" if version == "v3-tekken" else " "
    trim = version == "v3"

    def fmt(msgs: Messages, gen: bool) -> str:
        out, in_turn = [], False
        for m in msgs:
            if not in_turn:
                out.append(f"{lead}[INST]{trail}")
                in_turn = True
            r = _role(m)
            if r == "system":
                out.append(_text(m) + "\n\n")
            elif r == "user":
                out.append(f"{_text(m)}{lead}[/INST]")
            else:
                out.append(f"{trail}{_strip(m) if trim else _text(m)}</s>")
                in_turn = False
        return "".join(out)
    return fmt


def _llama2(system: bool, bos_inside: bool = False, strip: bool = False) -> Formatter:
    def fmt(msgs: Messages, gen: bool) -> str:
        out, in_turn = ["[INST] "], True
        for m in msgs:
            r, c = _role(m), (_strip(m) if strip else _text(m))
            if not in_turn:
                in_turn = True
                out.append("<s>[INST] " if bos_inside else "[INST] ")
            if r == "system":
                out.append(f"<<SYS>>\n{c}\n<</SYS>>\n\n" if system else f"{c}\n")
            elif r == "user":
                out.append(f"{c} [/INST]")
            else:
                out.append(f"{c}</s>")
                in_turn = False
        return "".join(out)
    return fmt


def _per_message(fmt_one: Callable[[dict], str], gen_prompt: str, prefix: str = "") -> Formatter:
    def fmt(msgs: Messages, gen: bool) -> str:
        return prefix + "".join(fmt_one(m) for m in msgs) + (gen_prompt if gen else "")
    return fmt


def _monarch(msgs: Messages, gen: bool) -> str:
    out = "".join(("" if i == 0 else "<s>") + f"{_role(m)}\n{_text(m)}</s>\n" for i, m in enumerate(msgs))
    return out + ("<s>assistant\n" if gen else "")


def _gemma(msgs: Messages, gen: bool) -> str:
    out, system = [], ""
    for m in msgs:
        r = _role(m)
        if r == "system":  # no system turn in gemma: merged into the next user turn
            system += _strip(m)
            continue
        r = "model" if r == "assistant" else r
        out.append(f"<start_of_turn>{r}\n")
        if system and r != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(f"{_strip(m)}<end_of_turn>\n")
    return "".join(out) + ("<start_of_turn>model\n" if gen else "")


def _orion(msgs: Messages, gen: bool) -> str:
    out, system = [], ""
    for m in msgs:
        r = _role(m)
        if r == "system":
            system += _text(m)
        elif r == "user":
            out.append("Human: " + (system + "\n\n" if system else "") + _text(m) + "\n\nAssistant: </s>")
            system = ""
        else:
            out.append(_text(m) + "</s>")
    return "".join(out)


def _openchat(msgs: Messages, gen: bool) -> str:
    out = []
    for m in msgs:
        r = _role(m)
        if r == "system":
            out.append(_text(m) + "<|end_of_turn|>")
        else:
            out.append(f"GPT4 Correct {r[:1].upper() + r[1:]}: {_text(m)}<|end_of_turn|>")
    return "".join(out) + ("GPT4 Correct Assistant:" if gen else "")


def _vicuna(orca: bool) -> Formatter:
    def fmt(msgs: Messages, gen: bool) -> str:
        out = []
        for m in msgs:
            r = _role(m)
            if r == "system":
                out.append(f"SYSTEM: {_text(m)}\n" if orca else f"{_text(m)}\n\n")
            elif r == "user":
                out.append(f"USER: {_text(m)}\n")
            elif r == "assistant":
                out.append(f"ASSISTANT: {_text(m)}</s>\n")
        return "".join(out) + ("ASSISTANT:" if gen else "")
    return fmt


def _by_role(table: dict[str, Callable[[dict], str]], gen_prompt: str, prefix: str = "") -> Formatter:
    def fmt(msgs: Messages, gen: bool) -> str:
        out = [prefix]
        for m in msgs:
            f = table.get(_role(m))
            if f is not None:
                out.append(f(m))
        return "".join(out) + (gen_prompt if gen else "")
    return fmt


def _minicpm(msgs: Messages, gen: bool) -> str:
    return "".join(f"<用户>{_strip(m)}<AI>" if _role(m) == "user" else _strip(m) for m in msgs)


def _rwkv(msgs: Messages, gen: bool) -> str:
    out = []
    for i, m in enumerate(msgs):
        r = _role(m)
        if r == "system":
            out.append(f"System: {_strip(m)}\n\n")
        elif r == "user":
            out.append(f"User: {_strip(m)}\n\n")
            if i == len(msgs) - 1:
                out.append("Assistant:")
        elif r == "assistant":
            out.append(f"Assistant: {_strip(m)}\n\n")
    return "".join(out)


def _granite(msgs: Messages, gen: bool) -> str:
    out = []
    for m in msgs:
        r = _role(m)
        out.append(f"<|start_of_role|>{r}<|end_of_role|>" + ("<|tool_call|>" if r == "assistant_tool_call" else "")
                   + f"{_text(m)}<|end_of_text|>\n")
    return "".join(out) + ("<|start_of_role|>assistant<|end_of_role|>\n" if gen else "")


def _gigachat(msgs: Messages, gen: bool) -> str:
    has_system = bool(msgs) and _role(msgs[0]) == "system"
    out = [f"<s>{_text(msgs[0])}<|message_sep|>" if has_system else "<s>"]
    for m in msgs[1 if has_system else 0:]:
        r = _role(m)
        if r == "user":
            out.append(f"user<|role_sep|>{_text(m)}<|message_sep|>available functions<|role_sep|>[]<|message_sep|>")
        elif r == "assistant":
            out.append(f"assistant<|role_sep|>{_text(m)}<|message_sep|>")
    return "".join(out) + ("assistant<|role_sep|>" if gen else "")


def _yandex(msgs: Messages, gen: bool) -> str:
    out = ["<s>"]
    for m in msgs:
        r = _role(m)
        if r == "user":
            out.append(f" Пользователь: {_text(m)}\n\n")
        elif r == "assistant":
            out.append(f" Ассистент: {_text(m)}\n\n")
    return "".join(out) + (" Ассистент:[SEP]" if gen else "")


def _bailing(msgs: Messages, gen: bool) -> str:
    out = []
    for m in msgs:
        r = _role(m)
        out.append(f"<role>{'HUMAN' if r == 'user' else r.upper()}</role>{_text(m)}")
    return "".join(out) + ("<role>ASSISTANT</role>" if gen else "")


def _smolvlm(msgs: Messages, gen: bool) -> str:
    out = ["<|im_start|>"]
    for m in msgs:
        r = _role(m)
        if r == "system":
            out.append(_text(m) + "\n\n")
        elif r == "user":
            out.append(f"User: {_text(m)}<end_of_utterance>\n")
        else:
            out.append(f"Assistant: {_text(m)}<end_of_utterance>\n")
    return "".join(out) + ("Assistant:" if gen else "")


def _hunyuan_moe(msgs: Messages, gen: bool) -> str:
    out = []
    for m in msgs:
        r = _role(m)
        if r == "system":
            out.append(f"<|startoftext|>{_text(m)}<|extra_4|>")
        elif r == "assistant":
            out.append(f"{_text(m)}<|eos|>")
        else:
            out.append(f"<|startoftext|>{_text(m)}<|extra_0|>")
    return "".join(out)


_EOS_DS = "<｜end▁of▁sentence｜>"

BUILTIN: dict[str, Formatter] = {
    "chatml": _chatml,
    "llama2": _llama2(system=False),
    "llama2-sys": _llama2(system=True),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True),
    "llama2-sys-strip": _llama2(system=True, strip=True),
    "mistral-v1": _mistral("v1"),
    "mistral-v3": _mistral("v3"),
    "mistral-v3-tekken": _mistral("v3-tekken"),
    "mistral-v7": _mistral_v7(tekken=False),
    "mistral-v7-tekken": _mistral_v7(tekken=True),
    "phi3": _per_message(lambda m: f"<|{_role(m)}|>\n{_text(m)}<|end|>\n", "<|assistant|>\n"),
    "phi4": _per_message(lambda m: f"<|im_start|>{_role(m)}<|im_sep|>{_text(m)}<|im_end|>",
                         "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _per_message(lambda m: f"<|{_role(m)}|>\n{_text(m)}\n", "<|assistant|>\n"),
    "zephyr": _per_message(lambda m: f"<|{_role(m)}|>\n{_text(m)}<|endoftext|>\n", "<|assistant|>\n"),
    "monarch": _monarch,
    "gemma": _gemma,
    "orion": _orion,
    "openchat": _openchat,
    "vicuna": _vicuna(orca=False),
    "vicuna-orca": _vicuna(orca=True),
    "deepseek": _by_role({"system": _text,
                          "user": lambda m: f"### Instruction:\n{_text(m)}\n",
                          "assistant": lambda m: f"### Response:\n{_text(m)}\n<|EOT|>\n"}, "### Response:\n"),
    "deepseek2": _by_role({"system": lambda m: _text(m) + "\n\n",
                           "user": lambda m: f"User: {_text(m)}\n\n",
                           "assistant": lambda m: f"Assistant: {_text(m)}{_EOS_DS}"}, "Assistant:"),
    "deepseek3": _by_role({"system": lambda m: _text(m) + "\n\n",
                           "user": lambda m: f"<｜User｜>{_text(m)}",
                           "assistant": lambda m: f"<｜Assistant｜>{_text(m)}{_EOS_DS}"}, "<｜Assistant｜>"),
    "command-r": _by_role({
        "system": lambda m: f"<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{_strip(m)}<|END_OF_TURN_TOKEN|>",
        "user": lambda m: f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{_strip(m)}<|END_OF_TURN_TOKEN|>",
        "assistant": lambda m: f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{_strip(m)}<|END_OF_TURN_TOKEN|>"},
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _per_message(lambda m: f"<|start_header_id|>{_role(m)}<|end_header_id|>\n\n{_strip(m)}<|eot_id|>",
                           "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "chatglm3": _per_message(lambda m: f"<|{_role(m)}|>\n {_text(m)}", "<|assistant|>", prefix="[gMASK]sop"),
    "chatglm4": _per_message(lambda m: f"<|{_role(m)}|>\n{_text(m)}", "<|assistant|>\n", prefix="[gMASK]<sop>"),
    "glmedge": _per_message(lambda m: f"<|{_role(m)}|>\n{_text(m)}", "<|assistant|>"),
    "minicpm": _minicpm,
    "exaone3": _by_role({"system": lambda m: f"[|system|]{_strip(m)}[|endofturn|]\n",
                         "user": lambda m: f"[|user|]{_strip(m)}\n",
                         "assistant": lambda m: f"[|assistant|]{_strip(m)}[|endofturn|]\n"}, "[|assistant|]"),
    "exaone4": _by_role({"system": lambda m: f"[|system|]{_strip(m)}[|endofturn|]\n",
                         "user": lambda m: f"[|user|]{_strip(m)}\n",
                         "assistant": lambda m: f"[|assistant|]{_strip(m)}[|endofturn|]\n",
                         "tool": lambda m: f"[|tool|]{_strip(m)}[|endofturn|]\n"}, "[|assistant|]"),
    "rwkv-world": _rwkv,
    "granite": _granite,
    "gigachat": _gigachat,
    "megrez": _per_message(lambda m: f"<|role_start|>{_role(m)}<|role_end|>{_text(m)}<|turn_end|>",
                           "<|role_start|>assistant<|role_end|>"),
    "yandex": _yandex,
    "bailing": _bailing,
    "llama4": _per_message(lambda m: f"<|header_start|>{_role(m)}<|header_end|>\n\n{_strip(m)}<|eot|>",
                           "<|header_start|>assistant<|header_end|>\n\n"),
    "smolvlm": _smolvlm,
    "hunyuan-moe": _hunyuan_moe,
}

# llama-server names whose layouts pyllama does not have: refused with a pointer to the Jinja route
UNSUPPORTED_BUILTIN = ("hunyuan-dense", "kimi-k2", "bailing-think", "bailing2", "seed_oss", "grok-2",
                       "pangu-embedded", "gpt-oss", "solar-open", "deepseek-ocr", "granite-4.0", "granite-4.1",
                       "hunyuan-vl", "dots1", "openai-moe", "exaone-moe")


def detect(source: str) -> str:
    """The built-in layout a Jinja template resembles (llama.cpp's guess for --no-jinja), or ''."""
    def has(*parts: str) -> bool:
        return all(p in source for p in parts)
    if source in BUILTIN:
        return source
    if has("<|im_start|>"):
        return "phi4" if has("<|im_sep|>") else "smolvlm" if has("<end_of_utterance>") else "chatml"
    if source.startswith("mistral") or has("[INST]"):
        if has("[SYSTEM_PROMPT]"):
            return "mistral-v7"
        if has("' [INST] ' + system_message") or has("[AVAILABLE_TOOLS]"):
            return "mistral-v1" if has(" [INST]") else "mistral-v3-tekken" if has('"[INST]"') else "mistral-v3"
        if has("content.strip()"):
            return "llama2-sys-strip"
        if has("bos_token + '[INST]"):
            return "llama2-sys-bos"
        return "llama2-sys" if has("<<SYS>>") else "llama2"
    checks = (
        (("<|assistant|>", "<|end|>"), "phi3"), (("[gMASK]<sop>",), "chatglm4"),
        (("<|assistant|>", "<|user|>", "</s>"), "falcon3"), (("<|assistant|>", "<|user|>"), "glmedge"),
        (("<|user|>", "<|endoftext|>"), "zephyr"), (("bos_token + message['role']",), "monarch"),
        (("<start_of_turn>",), "gemma"), (("'\\n\\nAssistant: ' + eos_token",), "orion"),
        (("GPT4 Correct ",), "openchat"), (("USER: ", "ASSISTANT: ", "SYSTEM: "), "vicuna-orca"),
        (("USER: ", "ASSISTANT: "), "vicuna"), (("### Instruction:", "<|EOT|>"), "deepseek"),
        (("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"), "command-r"),
        (("<|start_header_id|>", "<|end_header_id|>"), "llama3"), (("[gMASK]sop",), "chatglm3"),
        (("<用户>",), "minicpm"), (("'Assistant: ' + message['content'] + eos_token",), "deepseek2"),
        (("<｜Assistant｜>", "<｜User｜>", _EOS_DS), "deepseek3"),
        (("[|system|]", "[|assistant|]", "[|endofturn|]", "[|tool|]"), "exaone4"),
        (("[|system|]", "[|assistant|]", "[|endofturn|]"), "exaone3"),
        (("rwkv-world",), "rwkv-world"), (("<|start_of_role|>",), "granite"),
        (("message['role'] + additional_special_tokens[0] + message['content'] + additional_special_tokens[1]",),
         "gigachat"),
        (("<|role_start|>",), "megrez"), ((" Ассистент:",), "yandex"),
        (("<role>ASSISTANT</role>", "'HUMAN'"), "bailing"), (("<|header_start|>", "<|header_end|>"), "llama4"),
        (("<|startoftext|>", "<|extra_4|>"), "hunyuan-moe"),
    )
    for parts, name in checks:
        if has(*parts):
            return name
    return ""
