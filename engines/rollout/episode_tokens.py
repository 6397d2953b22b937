"""An episode's tokens between turns: the model's sampled tokens are kept as they are, and only what the
environment adds is rendered, through the tokenizer's chat template.

Re-tokenising a conversation's text can split the model's own tokens differently from how it sampled
them, and the trainer would then score tokens the policy never chose. So the template renders only the
observation: the text the template writes after an assistant turn, its rendering of the observation
messages and the next generation prompt, found after a probe turn in a render of probe + observation
(only what follows the probe: templates such as Qwen3's render earlier assistant turns differently
once another message follows), and tokenised alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from alignflow.agents.tools import CALL, OPEN_CALL, openai_tool_calls

PROBE = "\x00alignflow-turn\x00"


class EpisodeTokens:
    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self._probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: list[dict]) -> list[int]:
        """The episode's prompt: its first observation, the tools and the generation prompt."""
        return self._encode(self._render(messages, generation_prompt=True))

    def observation(self, messages: list[dict], stop_token: int | None) -> list[int]:
        """The tokens after a turn: the template's end of that turn, `messages` and the next generation prompt.
        `stop_token`: the token the model ended the turn with, where it stopped at one of its stop ids (None:
        cut by its token limit). Where the template's end of the turn begins with that token (the tokenizer's
        EOS, or Gemma's <end_of_turn> where its tokenizer's EOS is <eos>: vLLM stops at every id of the
        generation config), it is not written again; otherwise (Qwen2.5 stopped at <|endoftext|>, its turns
        ending in <|im_end|>; a cut turn) the whole end follows."""
        full = self._render(self._probe + list(messages), generation_prompt=True)
        after = full[full.rindex(PROBE) + len(PROBE):]  # the end of the turn, the observation, the next prompt
        if stop_token is not None and stop_token in self.tokenizer.added_tokens_decoder:  # written as itself
            written = self.tokenizer.convert_ids_to_tokens(stop_token)
            if after.startswith(written):
                after = after[len(written):]
        return self._encode(after)


@dataclass
class ServedSequence:
    """One episode's tokens as the agent endpoint (engines/rollout/endpoint.py) served them."""

    messages: list[tuple[str, str]]  # (role, content) of the conversation so far, its answers included (`said`)
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    last_cut: bool = False
    last_text: str = ""


def flat(message: dict) -> dict:
    """A chat message with its content as one string: OpenAI's list of parts (`[{"type": "text", "text": ...}]`)
    joined by newlines, as vLLM's server joins them, where chat templates (Qwen2.5's) take a string."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {**message, "content": text}


def said(messages: list[dict]) -> list[tuple[str, str]]:
    """(role, content) of each message, as a conversation is compared with the one served so far."""
    return [(m.get("role"), m.get("content") or "") for m in map(flat, messages)]


def _calls(message: dict) -> list[tuple[str, object]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((fn.get("name"), args))
    return out


def continues(served: list[tuple[str, str]], messages: list[dict]) -> bool:
    """Whether `messages` extend the conversation `served` so far (and add to it). An assistant turn matches the
    text it was served as, or, as agents echo a turn back through OpenAI's client or vLLM's tool parser, the same
    tool calls with its content empty, the served text outside them, or (vLLM's hermes parser) before them."""
    if len(messages) <= len(served):
        return False
    for (role, text), message in zip(served, map(flat, messages)):
        content = message.get("content") or ""
        if (message.get("role"), content) == (role, text):
            continue
        if role != "assistant" or message.get("role") != "assistant" or not message.get("tool_calls"):
            return False
        served_calls = _calls({"tool_calls": openai_tool_calls(text)})
        if _calls(message) != served_calls or content.strip() not in ("", CALL.sub("", text).strip(),
                                                                      text.split(OPEN_CALL, 1)[0].strip()):
            return False
    return True
