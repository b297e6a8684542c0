"""Chat-template rendering for multi-turn rollouts, in token ids, appended and never re-encoded.

A trajectory's ids grow by appending: turn ``k+1``'s prompt is turn ``k``'s prompt, the ids the
engine sampled (ending with the turn-end token, e.g. ``<|im_end|>``) and the observation ids.
The observation ids are what the chat template renders between the end of an assistant
turn and the start of the next one: the rest of the assistant message after its turn-end
token (``"\\n"`` for ChatML), the tool-role messages and the generation prompt.
:class:`ChatRenderer` finds that text by rendering a two-message probe conversation with
and without the tool messages and tokenises it once (:meth:`ChatRenderer.observation_ids`).

:meth:`ChatRenderer.matches_template` checks a finished trajectory: its ids must equal the
template's rendering of the whole conversation (the assistant turns decoded from the
sampled ids for this check only) up to the trajectory's length. Templates that do not
append - e.g. ones that drop the reasoning of earlier assistant turns - fail this check.
The rollout keeps the appended ids anyway (they are what the engine actually conditioned
on, so log-probs and importance ratios stay right); the failure is counted in the
``agent/template_mismatch`` metric so a template change shows up.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_PROBE = [{"role": "user", "content": "probe-user"}, {"role": "assistant", "content": "probe-assistant"}]


class ChatRenderer:
    """Renders prompts and observations of one tokenizer's chat template as token ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        turn_end: the text of the token that ends an assistant turn (``<|im_end|>`` for ChatML).

    Raises:
        ValueError: no chat template, ``turn_end`` not in the template's assistant turn, a
            template without a tool role (a tool message's content is not rendered), or
            one that does not render a conversation extended by tool messages as an
            extension of its rendering without them.
    """

    def __init__(self, tokenizer: Any, turn_end: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; multi-turn rollouts need one with a tool role")
        self.tokenizer = tokenizer
        self.turn_end = turn_end
        before = self._render(_PROBE, add_generation_prompt=False)
        assistant = before.find(_PROBE[1]["content"])
        if assistant < 0 or turn_end not in before[assistant:]:
            raise ValueError(f"the chat template does not end an assistant turn with {turn_end!r}")
        self._after_turn_end = before[before.rindex(turn_end) + len(turn_end):]
        after = self._render(_PROBE + [{"role": "tool", "name": "calculator", "content": "probe-observation"}],
                             add_generation_prompt=True)
        #: whether the template renders a conversation extended by tool messages as an extension
        #: of its rendering without them (False e.g. for templates that drop earlier reasoning)
        self.appends = after.startswith(before)
        self.observation_text([("calculator", "probe-observation")])  # refuses templates without a tool role

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The first turn's prompt: ``messages`` and tool specs rendered with the generation prompt."""
        return self._encode(self._render(messages, add_generation_prompt=True, tools=tools))

    def observation_text(self, observations: Sequence[tuple[str, str]]) -> str:
        """The text between an assistant turn's end token and the next assistant turn's first token.

        Found in the rendering of the probe conversation (user, assistant) followed by the
        tool messages and the generation prompt: everything after the assistant turn's end
        token. This needs no appending template: a template that rewrites earlier turns
        still renders the tool messages after the assistant turn's end.

        Args:
            observations: ``(tool name, content)`` per tool message, in order.

        Raises:
            ValueError: a tool message's content is not rendered (no tool role).
        """
        messages = [{"role": "tool", "name": name, "content": content} for name, content in observations]
        after = self._render(_PROBE + messages, add_generation_prompt=True)
        user_end = after.index(self.turn_end, after.index(_PROBE[0]["content"]))
        assistant_end = after.index(self.turn_end, user_end + len(self.turn_end))
        text = after[assistant_end + len(self.turn_end):]
        missing = [content for _, content in observations if content not in text]
        if missing:
            raise ValueError(f"the chat template has no tool role: a tool message's content ({missing[0]!r:.40}) "
                             f"is not rendered")
        return text

    def observation_ids(self, observations: Sequence[tuple[str, str]]) -> list[int]:
        """:meth:`observation_text` tokenised once (no special tokens added)."""
        return self._encode(self.observation_text(observations))

    def matches_template(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                         ids: Sequence[int]) -> bool:
        """Whether ``ids`` equal the template's rendering of ``messages`` up to ``len(ids)``.

        ``messages`` is the whole conversation (the last message may be an assistant turn);
        rendered without a generation prompt, the rendering may run past ``ids`` only by the
        turn-end token and what follows it (a trajectory cut at the length limit lacks them).
        """
        rendered = self._encode(self._render(messages, add_generation_prompt=False, tools=tools))
        tail = len(self._encode(self.turn_end + self._after_turn_end))  # a turn cut short lacks its end
        return list(rendered[:len(ids)]) == list(ids) and len(rendered) - len(ids) <= tail
