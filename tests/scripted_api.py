"""The server's real response path fed with known model text instead of a model's tokens: the
chat endpoints' replies (OpenAI, Anthropic, Responses) checked against what the clients' own
packages read, without a model."""
from __future__ import annotations

import types

from pyllama.batching.sampling import SamplingParams
from pyllama.server.api import Api, ChatOutputSpec, ServerState
from pyllama.server.chat import ChatTemplate
from pyllama.server.params import CompletionParams, parse_completion
from pyllama.server.reasoning import prompt_opens_thinking, thinking_opener
from pyllama.batching.task import CompletionTask, FinalEvent, ProgressEvent, TokenEvent

N_PROMPT, N_EVALUATED = 10, 4  # every scripted prompt: 10 tokens, 6 of them from the prompt cache
# a Hermes-template reply with text and one call, cut into the 4-character tokens a model would send
HERMES_CALL = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_CALL_PIECES = [HERMES_CALL[i:i + 4] for i in range(0, len(HERMES_CALL), 4)]


class ScriptedApi(Api):
    """Each task's model writes `pieces`, one token each, then ends with `stop_type`."""

    def __init__(self, state: ServerState, pieces: list[str], stop_type: str = "eos", stopping_word: str = "") -> None:
        super().__init__(state)
        self.pieces, self.stop_type, self.stopping_word = pieces, stop_type, stopping_word

    async def _events(self, task_lists):
        for ts in task_lists:
            for t in ts:
                if t.return_progress:  # placed: the prompt cache held N_PROMPT - N_EVALUATED of it
                    yield t.index, ProgressEvent(N_PROMPT, N_PROMPT - N_EVALUATED, N_PROMPT - N_EVALUATED, 0.0)
                for k, piece in enumerate(self.pieces):
                    yield t.index, TokenEvent(text=piece, token=k)
                yield t.index, FinalEvent(self.stop_type, self.stopping_word, N_PROMPT, N_EVALUATED,
                                          len(self.pieces), 1.0, 1.0, 0)


def scripted(template: str, chat: dict, pieces: list[str], stop_type: str = "eos", stopping_word: str = "",
             reasoning_format: str = "auto", skip_chat_parsing: bool = False
             ) -> tuple[ScriptedApi, CompletionParams, ChatOutputSpec, CompletionTask]:
    """(api, the chat body's parameters, how its reply is read, its task) as the chat endpoints
    prepare them, for a model that writes `pieces`."""
    state = ServerState(args=types.SimpleNamespace(reasoning_format=reasoning_format,
                                                   skip_chat_parsing=skip_chat_parsing),
                        chat=ChatTemplate(template, bos_token="<s>", eos_token="</s>"), model_alias="m")
    api = ScriptedApi(state, pieces, stop_type, stopping_word)
    p = parse_completion(chat, -1, 1, oai=True)
    spec = api._chat_output_spec(chat)
    text, spec.prefill = api._render_chat(chat)
    spec.forced_open = spec.thinks and prompt_opens_thinking(text, spec.family, spec.tags)  # as the server decides it
    spec.opener = thinking_opener(text, spec.family, spec.tags) if spec.forced_open else ""
    return api, p, spec, CompletionTask(prompt=list(range(N_PROMPT)), params=SamplingParams())
