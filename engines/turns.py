"""Where a conversation's assistant turns lie in its rendered tokens: multi-turn SFT's loss mask.

A supervised record's prompt may be a whole conversation (system, user,
assistant, user, ...), its response the last assistant reply. Trained on
its response only, the earlier assistant turns are context. With
`sft.train_on: assistant_turns` (OpenRLHF's --multiturn, TRL's
assistant_only_loss) the loss also covers each of them: the tokens the
chat template writes for assistant message i are those of

    render(messages[: i + 1])  after  render(messages[: i], generation prompt)

that is its content and the template's end of turn. This holds only for a
template that renders an earlier turn as it renders the same turn last
(Qwen3's drops earlier turns' reasoning, for one); a conversation where it
does not is an error that names the record and the turn, not a mask over
the wrong tokens.
"""

from __future__ import annotations

from alignflow.errors import DataError


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def assistant_spans(tokenizer, messages: list[dict], tools: list[dict] | None, rendered: list[int],
                    where: str) -> list[tuple[int, int]]:
    """[start, end) in `rendered` (the conversation rendered with its generation prompt, as
    `engines.batches.render_prompt` renders it) of each assistant message's tokens: its content and the
    template's end of turn. `where`: the record, for the error a template that re-renders earlier turns
    gets."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True)
        through = _render(tokenizer, messages[: i + 1], tools, False)
        if through[: len(before)] != before or rendered[: len(through)] != through or len(through) == len(before):
            raise DataError(
                f"{where}: assistant turn {i} (message {i + 1} of {len(messages)}) renders differently once the "
                f"conversation goes on: the chat template rewrites earlier turns (as Qwen3's drops their reasoning), "
                f"so its tokens cannot be found to train on. Set sft.train_on: response (the last reply only), "
                f"or give each assistant turn a record of its own")
        spans.append((len(before), len(through)))
    return spans
