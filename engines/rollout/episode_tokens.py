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

PROBE = "\x00alignflow-turn\x00"


class EpisodeTokens:
    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self._probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}]
        self._eos = tokenizer.eos_token or ""

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def start(self, messages: list[dict]) -> list[int]:
        """The episode's prompt: its first observation, the tools and the generation prompt."""
        return self._encode(self._render(messages, generation_prompt=True))

    def observation(self, messages: list[dict], last_token: int | None) -> list[int]:
        """The tokens after a turn whose last sampled token was `last_token`: the template's end of that turn,
        `messages` and the next generation prompt. Where the model ended the turn with the tokenizer's EOS,
        the template's EOS that follows the turn is not written again; a turn that ended any other way (cut by
        its token limit, or at another of the model's stop ids, such as Qwen2.5's <|endoftext|> where its turns
        end in <|im_end|>: vLLM stops at every id of the model's generation config) gets the whole end."""
        full = self._render(self._probe + list(messages), generation_prompt=True)
        after = full[full.rindex(PROBE) + len(PROBE):]  # the end of the turn, the observation, the next prompt
        ended = last_token is not None and last_token == self.tokenizer.eos_token_id
        if ended and self._eos and after.startswith(self._eos):
            after = after[len(self._eos):]
        return self._encode(after)
