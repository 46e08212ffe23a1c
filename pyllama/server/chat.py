"""Chat templates: OpenAI chat messages -> the prompt text a model was trained on.

A GGUF model carries its chat template as Jinja2 source in ``tokenizer.chat_template`` (the
Hugging Face convention). It is rendered here the way Hugging Face ``transformers`` renders it
(``apply_chat_template``): a sandboxed, immutable Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that
keeps non-ASCII text as is, the ``loopcontrols`` extension and the ``{% generation %}`` block tag.
A model without a template, or with one that does not compile, gets ChatML, as llama-server does.
llama-server's built-in template names (``--chat-template llama3``) select a built-in layout
(chat_builtin.py); :meth:`ChatTemplate.render_request` applies a chat request as llama-server
does: a final assistant message is continued (prefill), ``continue_final_message`` and
``add_generation_prompt`` are checked, ``chat_template_kwargs`` reach the template.

Everything that goes wrong with a request's messages or while rendering raises
:class:`ChatTemplateError`, which the HTTP layer answers with a 400.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, Optional

import jinja2
from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_builtin import BUILTIN, UNSUPPORTED_BUILTIN, detect
from .template_thinking import Thinking, template_thinking
from .tool_calls import detect_family

log = logging.getLogger(__name__)

__all__ = ["BUILTIN", "CHATML_TEMPLATE", "ChatTemplate", "ChatTemplateError", "template_from_option",
           "validate_messages"]

# llama.cpp's CHATML_TEMPLATE_SRC (common/chat.cpp), the template llama-server uses for a model
# that has none.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)

_IMAGE_PART_TYPES = frozenset({"image_url", "image", "input_image"})
_AUDIO_PART_TYPES = frozenset({"input_audio", "audio"})


class ChatTemplateError(ValueError):
    """Bad chat messages, or a chat template that fails to render them (HTTP 400)."""


# ---------------------------------------------------------------------------------------------
# Jinja2 environment


def _raise_exception(message: Any = "") -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | str | None = None, ensure_ascii: bool = False,
            separators: Any = None, sort_keys: bool = False) -> str:
    """HF's ``tojson``: plain ``json.dumps`` with ``ensure_ascii=False`` and no HTML escaping.

    Templates call it with keywords (``x | tojson(indent=4)``), which behaves exactly as in HF;
    a positional argument is taken as ``indent``, as Jinja2's own ``tojson`` does.
    """
    if isinstance(separators, list):
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=bool(ensure_ascii), indent=indent,
                      separators=separators, sort_keys=bool(sort_keys))


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):  # type: ignore[no-untyped-def]
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox in which touching an unsafe attribute fails at once.

    The stock sandbox returns an undefined value that prints as an empty string, so
    ``{{ ''.__class__ }}`` would silently render nothing; here it is an error.
    """

    def unsafe_undefined(self, obj: Any, attribute: str):  # type: ignore[override]
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _make_environment() -> jinja2.Environment:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---------------------------------------------------------------------------------------------
# Messages


def _join_content(where: str, content: list) -> str:
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise ChatTemplateError(f"{at}: a content part must be an object, got {_kind(part)}")
        ptype = part.get("type")
        if not isinstance(ptype, str):
            raise ChatTemplateError(f"{at}: 'type' must be a string")
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"{at}: 'text' must be a string")
            texts.append(text)
        elif ptype in _IMAGE_PART_TYPES:
            raise ChatTemplateError(f"{at}: this model does not support images")
        elif ptype in _AUDIO_PART_TYPES:
            raise ChatTemplateError(f"{at}: this model does not support audio")
        else:
            raise ChatTemplateError(f"{at}: unsupported content part type {ptype!r}")
    # llama.cpp joins the text parts of a message with newlines for text-only templates
    return "\n".join(texts)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _check_tool_calls(where: str, tool_calls: Any) -> None:
    """An assistant message's ``tool_calls``, in OpenAI's shape (as llama-server checks them)."""
    if not (isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)):
        raise ChatTemplateError(f"{where}: 'tool_calls' must be an array of objects")
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if call.get("type", "function") != "function":
            raise ChatTemplateError(f"{at}: 'type' must be \"function\"")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ChatTemplateError(f"{at}: 'function' must be an object with 'name' and 'arguments'")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{at}.function: 'name' must be a non-empty string")
        if not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise ChatTemplateError(f"{at}.function: 'arguments' must be a JSON string or an object")
        if "id" in call and call["id"] is not None and not isinstance(call["id"], str):
            raise ChatTemplateError(f"{at}: 'id' must be a string")


def validate_messages(messages: Any) -> list[dict]:
    """Check OpenAI chat messages and return copies ready for a template.

    Each message is an object with a non-empty string ``role`` and a ``content`` that is a
    string, an array of content parts or null (null or absent only for ``assistant`` messages,
    which may carry ``tool_calls`` instead). Text parts are joined with newlines; image and audio
    parts are refused, since this server runs text-only models. A null content becomes ``""``.
    Other fields (``name``, ``tool_calls``, ``tool_call_id``, ...) are passed to the template
    unchanged. The input is not modified.
    """
    if not isinstance(messages, list):
        raise ChatTemplateError(f"'messages' must be an array, got {_kind(messages)}")
    if not messages:
        raise ChatTemplateError("'messages' must contain at least one message")
    out: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatTemplateError(f"{where}: a message must be an object, got {_kind(msg)}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            if "role" not in msg:
                raise ChatTemplateError(f"{where}: missing 'role'")
            raise ChatTemplateError(f"{where}: 'role' must be a non-empty string")
        content = msg.get("content")
        if isinstance(content, str):
            pass
        elif isinstance(content, list):
            content = _join_content(where, content)
        elif content is None:
            if role != "assistant":
                raise ChatTemplateError(
                    f"{where}: 'content' is required for a {role!r} message")
            content = ""
        else:
            raise ChatTemplateError(
                f"{where}: 'content' must be a string or an array of content parts, "
                f"got {_kind(content)}")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            _check_tool_calls(where, tool_calls)
        copy = dict(msg)
        copy["content"] = content
        out.append(copy)
    return out


# ---------------------------------------------------------------------------------------------
# Template


class ChatTemplate:
    """A compiled chat template; :meth:`render` is safe to call from several threads."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 name: str | None = None, builtin: str | None = None, kwargs: dict | None = None,
                 prefill_assistant: bool = True, reasoning: str = "auto") -> None:
        """source: Jinja text (None or unusable: ChatML); builtin: a name of BUILTIN instead;
        kwargs: template variables every request gets (--chat-template-kwargs); prefill_assistant:
        a final assistant message is continued rather than closed (llama-server's default);
        reasoning: --reasoning ("on", "off" or "auto"), see :meth:`render_with_prefill`."""
        self.name = name
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.kwargs = dict(kwargs or {})
        self.prefill_assistant = prefill_assistant
        self.reasoning = reasoning
        self.builtin = builtin
        self._format = BUILTIN[builtin] if builtin else None
        self._caps: Optional[dict[str, bool]] = None
        self._thinking: Optional[tuple[Optional[Thinking]]] = None  # learnt once, see thinking
        self._variables: Optional[frozenset[str]] = None
        self._env = _make_environment()
        if builtin:
            self.is_fallback = False
            self._source = builtin
            return
        if isinstance(source, (bytes, bytearray)):
            source = bytes(source).decode("utf-8", errors="replace")
        self.is_fallback = True
        self._source = CHATML_TEMPLATE
        if source is not None and not isinstance(source, str):
            log.warning("chat template%s is not text (%s); using the ChatML fallback",
                        self._label(), type(source).__name__)
        elif source and source.strip():
            try:
                self._template = self._env.from_string(source)
            except Exception as e:  # TemplateSyntaxError, TemplateAssertionError, ...
                log.warning("chat template%s does not compile (%s); using the ChatML fallback",
                            self._label(), _describe(e))
            else:
                self._source = source
                self.is_fallback = False
        if self.is_fallback:
            self._template = self._env.from_string(CHATML_TEMPLATE)

    def _label(self) -> str:
        return f" of {self.name}" if self.name else ""

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` (a built-in layout reads none)."""
        if self._format is not None:
            return False
        if self._variables is None:
            self._variables = frozenset(meta.find_undeclared_variables(self._env.parse(self._source)))
        return name in self._variables

    @property
    def family(self) -> Optional[str]:
        """The tool-call format of this template (tool_calls.detect_family); None for a built-in
        layout, which cannot describe tools (llama-server needs --jinja for them too)."""
        if self._format is not None:
            return None
        return detect_family(self._source)

    @property
    def thinking(self) -> Optional[Thinking]:
        """The template's thinking tags, or None where llama-server reads its replies as content
        only (template_thinking.py): a built-in layout, or a template that does not think."""
        if self._thinking is None:
            if self._format is not None:
                self._thinking = (None,)
            else:
                def render(messages: list[dict], gen: bool, **kw: Any) -> str:
                    return self.render(messages, add_generation_prompt=gen, **kw)
                self._thinking = (template_thinking(self._source, render, self.caps["tool_calls"]),)
        return self._thinking[0]

    @property
    def caps(self) -> dict[str, bool]:
        """What the template does with tools, learnt once by rendering probe conversations (as
        llama.cpp's template capabilities): ``tools`` (lists the request's tools),
        ``tool_calls`` (shows an assistant's calls), ``tool_responses`` (shows tool results),
        ``object_arguments`` (expects a call's arguments as an object, e.g. ``| tojson``),
        ``parallel_tool_calls`` (shows two calls of one message), ``system_role`` (shows a system
        message), ``string_content`` / ``typed_content`` (shows content given as a string / as a
        list of text parts), ``preserve_reasoning`` (shows an earlier reply's reasoning_content)."""
        if self._caps is None:
            self._caps = self._probe()
        return self._caps

    def _probe(self) -> dict[str, bool]:
        def out(messages: list[dict], **kw: Any) -> str:
            try:
                return self.render(messages, add_generation_prompt=True, **kw)
            except ChatTemplateError:
                return ""
        user = {"role": "user", "content": "Hi"}
        tool = {"type": "function", "function": {"name": "probe_tool_name", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}

        def call_convo(args: Any) -> list[dict]:
            return [user, {"role": "assistant", "content": "",
                           "tool_calls": [{"id": "probe0001", "type": "function",
                                           "function": {"name": "probe_call_name", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "probe0001", "name": "probe_call_name",
                     "content": "probe_tool_result"}, user]
        as_object = out(call_convo({"probe_arg": 1}), tools=[tool])
        no_calls = call_convo({})
        del no_calls[1]["tool_calls"]
        # a template may show a call by its id alone (Kimi K2: functions.NAME:IDX), which the
        # tool's result shows too: seen when the call adds to the result's mentions
        ids_alone = out(no_calls, tools=[tool]).count("probe0001")
        as_string = out(call_convo('{"probe_arg": 1}'), tools=[tool])
        two = call_convo({"probe_arg": 1})
        two[1]["tool_calls"] = two[1]["tool_calls"] + [{"id": "probe0002", "type": "function", "function": {
            "name": "probe_second_name", "arguments": {"probe_arg": 2}}}]
        parallel = out(two, tools=[tool])
        thought = [user, {"role": "assistant", "content": "probe_reply", "reasoning_content": "probe_thought"}, user]
        typed = self._format is None and "probe_typed_text" in out(
            [{"role": "user", "content": [{"type": "text", "text": "probe_typed_text"}]}])
        return {"tools": "probe_tool_name" in out([user], tools=[tool]),
                "tool_calls": "probe_call_name" in as_object + as_string or
                              max(as_object.count("probe0001"), as_string.count("probe0001")) > ids_alone,
                "tool_responses": "probe_tool_result" in as_object + as_string,
                # JSON of the object, or (XML call formats) its keys walked, which a string cannot give
                "object_arguments": '"probe_arg": 1' in as_object or (
                    "probe_arg" in as_object and "probe_arg" not in as_string),
                "parallel_tool_calls": "probe_call_name" in parallel and "probe_second_name" in parallel,
                "system_role": "probe_system_text" in out([{"role": "system", "content": "probe_system_text"}, user]),
                "string_content": "probe_string_text" in out([{"role": "user", "content": "probe_string_text"}]),
                "typed_content": typed,
                "preserve_reasoning": "probe_thought" in out(thought)}

    def llama_caps(self) -> dict[str, bool]:
        """llama-server's /props `chat_template_caps`, from :attr:`caps`."""
        c = self.caps
        return {"supports_object_arguments": c["object_arguments"],
                "supports_parallel_tool_calls": c["parallel_tool_calls"],
                "supports_preserve_reasoning": c["preserve_reasoning"], "supports_string_content": c["string_content"],
                "supports_system_role": c["system_role"], "supports_tool_calls": c["tool_calls"],
                "supports_tools": c["tools"], "supports_typed_content": c["typed_content"]}

    @property
    def source(self) -> str:
        """The template text in use (the ChatML fallback when the model's was missing or bad)."""
        return self._source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list | None = None, **kwargs: Any) -> str:
        """Render validated ``messages`` (see :func:`validate_messages`) to prompt text.

        ``kwargs`` become extra template variables (e.g. ``enable_thinking``, ``date_string``)
        and may override ``bos_token`` / ``eos_token``. Any failure, including a template's own
        ``raise_exception`` and sandbox violations, raises :class:`ChatTemplateError`.
        """
        if self._format is not None:
            return self._format(messages, bool(add_generation_prompt))
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(kwargs)
        context["messages"] = messages
        context["add_generation_prompt"] = bool(add_generation_prompt)
        if tools:  # undefined without tools, as llama.cpp renders it (templates test `tools is defined`)
            context["tools"] = tools
        try:
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except RecursionError as e:
            raise ChatTemplateError("chat template error: recursion too deep") from e
        except Exception as e:
            raise ChatTemplateError(f"chat template error: {_describe(e)}") from e

    def render_request(self, body: dict, add_generation_prompt: Any = None) -> str:
        """A chat request's prompt text (see :meth:`render_with_prefill`)."""
        return self.render_with_prefill(body, add_generation_prompt)[0]

    def render_with_prefill(self, body: dict, add_generation_prompt: Any = None) -> tuple[str, str]:
        """(prompt text, prefill): a chat request's prompt, as llama-server builds it from the body's ``messages``,
        ``tools``, ``add_generation_prompt`` (default true), ``continue_final_message`` and
        ``chat_template_kwargs`` (over the server's own).

        A final assistant message is continued (prefill, unless the server was started with
        --no-prefill-assistant): the conversation before it is rendered with the generation
        prompt, then its content follows as is, so the model goes on from its last character.
        Refused as llama-server refuses them: two assistant messages at the end, an explicit
        ``continue_final_message`` together with ``add_generation_prompt`` true, continuing a
        message that holds tool calls. The prefill is the continued message's content (the end of
        the prompt; "" when nothing is continued): llama-server's reply starts with it."""
        if not isinstance(body, dict):
            raise ChatTemplateError("the request body must be a JSON object")
        messages = validate_messages(body.get("messages"))
        add_gen = body.get("add_generation_prompt", True) if add_generation_prompt is None else add_generation_prompt
        if not isinstance(add_gen, bool):
            raise ChatTemplateError("'add_generation_prompt' must be true or false")
        cont = body.get("continue_final_message")
        if cont is not None and not isinstance(cont, bool) and cont not in ("content", "auto"):
            raise ChatTemplateError("'continue_final_message' must be true, false or \"content\"")
        cont = bool(cont)
        if not cont and self.prefill_assistant and messages[-1]["role"] == "assistant":
            if len(messages) >= 2 and messages[-2]["role"] == "assistant":
                raise ChatTemplateError("Cannot have 2 or more assistant messages at the end of the list.")
            cont, add_gen = True, False
        if cont and add_gen:
            raise ChatTemplateError("Cannot set both add_generation_prompt and continue_final_message to true.")
        if cont and messages[-1]["role"] != "assistant":
            raise ChatTemplateError("'continue_final_message' needs an assistant message at the end of the list")
        if cont and messages[-1].get("tool_calls"):
            raise ChatTemplateError("Cannot continue an assistant message that contains tool calls.")
        extra = body.get("chat_template_kwargs")
        if extra is not None and not isinstance(extra, dict):
            raise ChatTemplateError("'chat_template_kwargs' must be an object")
        # llama-server always gives the template enable_thinking: true where the template thinks
        # (unless --reasoning off), false where it does not, --chat-template-kwargs and the
        # request's chat_template_kwargs over that (server-context.cpp, server-common.cpp)
        kwargs = {**self.kwargs, **(extra or {})}
        if self._format is None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = self.reasoning != "off" and self.thinking is not None
        for reserved in ("messages", "add_generation_prompt", "tools"):
            kwargs.pop(reserved, None)
        self._reasoning_effort(body.get("reasoning_effort"), kwargs, extra or {})
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ChatTemplateError("'tools' must be an array of tools")
        if tools and self._format is not None:
            raise ChatTemplateError("tools param requires --jinja flag")
        messages = self._tool_messages(messages, tools or None, body.get("tool_choice") != "none")
        if cont:
            head = self.render(messages[:-1], add_generation_prompt=True, tools=tools, **kwargs)
            return head + messages[-1]["content"], messages[-1]["content"]
        return self.render(messages, add_generation_prompt=add_gen, tools=tools, **kwargs), ""

    def _reasoning_effort(self, effort: Any, kwargs: dict, extra: dict) -> None:
        """OpenAI's reasoning_effort: "none" turns thinking off (enable_thinking false, as
        llama-server); another level reaches a template that reads ``reasoning_effort`` (gpt-oss's
        harmony templates do), unless chat_template_kwargs sets it; a template without levels
        cannot honour one, which is an error rather than a level silently dropped."""
        if effort is None:
            return
        if not isinstance(effort, str) or not effort:
            raise ChatTemplateError("'reasoning_effort' must be a string such as \"low\", \"medium\", \"high\" "
                                    "or \"none\"")
        if effort == "none":
            kwargs["enable_thinking"] = False
        elif "reasoning_effort" not in extra:
            if not self.reads("reasoning_effort"):
                raise ChatTemplateError(f"'reasoning_effort' {effort!r} is not supported: this model's chat template "
                                        "has no reasoning effort levels (\"none\" turns its thinking off)")
            kwargs["reasoning_effort"] = effort

    def _tool_messages(self, messages: list[dict], tools: Optional[list], use_tools: bool) -> list[dict]:
        """Messages shaped for what this template understands, as llama.cpp adapts them:
        arguments as objects where the template expects objects; where it cannot show calls or
        tool results, they become JSON text in the content (a result as a user message); and for
        the generic format, a system message that lists the tools and the reply format."""
        if self._format is not None or not (tools or any(m.get("tool_calls") or m["role"] == "tool"
                                                         for m in messages)):
            return messages
        caps = self.caps
        out: list[dict] = []
        for i, m in enumerate(messages):
            calls = m.get("tool_calls")
            if calls:
                m = dict(m)
                if caps["tool_calls"]:
                    if caps["object_arguments"]:
                        m["tool_calls"] = [_object_args(f"messages[{i}].tool_calls[{j}]", c)
                                           for j, c in enumerate(calls)]
                else:
                    listed = [{"name": c["function"]["name"],
                               "arguments": _object_args(f"messages[{i}].tool_calls[{j}]", c)["function"]["arguments"],
                               **({"id": c["id"]} if c.get("id") else {})} for j, c in enumerate(calls)]
                    text = json.dumps({"tool_calls": listed}, ensure_ascii=False, indent=2)
                    m["content"] = (m["content"] + "\n" + text) if m["content"] else text
                    del m["tool_calls"]
            elif m["role"] == "tool" and not caps["tool_responses"]:
                response = {"tool": m.get("name", ""), "content": m["content"]}
                if m.get("tool_call_id"):
                    response["tool_call_id"] = m["tool_call_id"]
                m = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False, indent=2)}
            out.append(m)
        if tools and use_tools and not caps["tools"] and self.family == "generic":
            listing = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, indent=2)
            note = ("You can call these tools:\n" + listing + "\n\nReply with one JSON object: "
                    '{"tool_calls": [{"name": <tool name>, "arguments": {...}}]} to call tools, or '
                    '{"response": <your answer>} to answer directly.')
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
        return out

    def __repr__(self) -> str:
        kind = "ChatML fallback" if self.is_fallback else f"{len(self._source)} chars"
        return f"ChatTemplate({self.name or 'unnamed'}, {kind})"


def _object_args(where: str, call: dict) -> dict:
    """A copy of a tool call whose arguments are an object (parsed from OpenAI's JSON string)."""
    fn = call["function"]
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ChatTemplateError(f"{where}.function: 'arguments' is not valid JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def _describe(e: BaseException) -> str:
    msg = str(e)
    lineno = getattr(e, "lineno", None)
    if lineno:
        msg = f"line {lineno}: {msg}"
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def is_jinja(text: str) -> bool:
    return "{%" in text or "{{" in text


def template_from_option(option: str | None, model_source: Any, jinja: bool = True, bos_token: str = "",
                         eos_token: str = "", kwargs: dict | None = None,
                         prefill_assistant: bool = True, reasoning: str = "auto") -> ChatTemplate:
    """The server's chat template from --chat-template (a built-in name or Jinja text; None: the
    model's own), --jinja/--no-jinja and the model's ``tokenizer.chat_template``.

    With --no-jinja, Jinja text (the model's or the option's) selects the built-in layout it
    resembles, as llama-server does; none resembling it: ChatML with a warning for the model's,
    an error for the option's. Text that is neither a built-in name nor Jinja is an error, never
    a template that renders itself."""
    common = dict(bos_token=bos_token, eos_token=eos_token, kwargs=kwargs, prefill_assistant=prefill_assistant,
                  reasoning=reasoning)
    if option is not None:
        name = option.strip()
        if name in BUILTIN:
            return ChatTemplate(None, name=name, builtin=name, **common)
        if name in UNSUPPORTED_BUILTIN:
            raise ChatTemplateError(f"llama-server's built-in template '{name}' is not supported by pyllama; "
                                    "pass the model's Jinja template with --chat-template-file")
        if not is_jinja(option):
            raise ChatTemplateError(f"'{_short(option)}' is neither a built-in template name ("
                                    f"{', '.join(sorted(BUILTIN))}) nor Jinja template text")
        if not jinja:
            found = detect(option)
            if not found:
                raise ChatTemplateError("--no-jinja: this template resembles no built-in layout; use --jinja")
            return ChatTemplate(None, name=found, builtin=found, **common)
        try:
            _make_environment().from_string(option)
        except Exception as e:  # noqa: BLE001 - any compile failure is the user's template's
            raise ChatTemplateError(f"the template does not compile ({_describe(e)})") from None
        return ChatTemplate(option, name="--chat-template", **common)
    if isinstance(model_source, (bytes, bytearray)):
        model_source = bytes(model_source).decode("utf-8", errors="replace")
    if not jinja:
        found = detect(model_source) if isinstance(model_source, str) and model_source else ""
        if not found:
            if model_source:
                log.warning("--no-jinja: the model's chat template resembles no built-in layout; using chatml")
            found = "chatml"
        return ChatTemplate(None, name=found, builtin=found, **common)
    return ChatTemplate(model_source, name="the model", **common)


def _short(text: str, n: int = 40) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."
