"""Turning a prompt or a conversation into token ids for each model (docs/design.md, section 7).

The target always gets its own chat template. The drafter gets one of two renderings of the same conversation:
`own` (its own chat template, or plain text for a base model) or `stripped` (the target's rendered text with the
special tokens removed, what transformers' assisted generation feeds it). `auto` measures both on the pair and keeps
the one whose drafts the target accepts more often. Base models without a template get a plain-text rendering.
"""

from __future__ import annotations

from .memory import PairMemory, RenderingTally
from .settings import short_repr
from .utf8 import not_text

ROLES = ("system", "user", "assistant")
_TRIES = 2
"""Generations each drafter rendering gets before `auto` judges them."""


class PromptError(ValueError):
    """The prompt or conversation cannot be used as given; the message says what to change."""


def check_prompt(prompt) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptError("the prompt is empty; type a question or some text to continue")
    _check_text(prompt, "the prompt")
    return prompt


def _check_text(text: str, what: str) -> None:
    problem = not_text(text)
    if problem:
        raise PromptError(f"{what} is not valid text: it holds {problem}; send it as valid Unicode (UTF-8)")


def user_turn(prompt) -> list[dict]:
    """A conversation of one user message: the prompt as a chat model is asked it, through its chat template."""
    return [{"role": "user", "content": check_prompt(prompt)}]


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise PromptError(
                f"message {i} must be an object with exactly the keys 'role' and 'content', got {short_repr(m)}"
            )
        if m["role"] not in ROLES:
            raise PromptError(f"message {i} has role {short_repr(m['role'])}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise PromptError(f"message {i} content must be text, got {type(m['content']).__name__}")
        _check_text(m["content"], f"message {i}'s content")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise PromptError(f"the last message must be the user's (the model answers it), got {out[-1]['role']!r}")
    if not out[-1]["content"].strip():
        raise PromptError("the last user message is empty; type a question or a prompt")
    return out


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_text(messages: list[dict]) -> str:
    """A conversation as plain text for a base model: role headers a pretrained model has seen in dialogue."""
    turns = [f"{m['role'].capitalize()}: {m['content'].strip()}" for m in messages]
    return "\n\n".join(turns) + "\n\nAssistant:"


def render_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation in the model's own chat template, ready for the assistant's answer."""
    if has_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)  # the template already holds bos where it wants one
    return tokenizer.encode(plain_text(messages))


def stripped_ids(target_tokenizer, target_ids: list[int], drafter_tokenizer) -> list[int]:
    text = target_tokenizer.decode(target_ids, skip_special_tokens=True)
    return drafter_tokenizer.encode(text)


def choose_rendering(memory: PairMemory, asked: str) -> str:
    """`own` or `stripped` for this generation; `auto` tries each _TRIES times, then keeps the better acceptance.
    `asked` is a checked setting (GenerationSettings.drafter_rendering)."""
    if asked != "auto":
        return asked
    seen = memory.rendering
    for r in ("own", "stripped"):
        if r not in seen or seen[r].generations < _TRIES:
            return r
    return max(("own", "stripped"), key=lambda r: seen[r].accepted / max(1, seen[r].drafted))


def record_rendering(memory: PairMemory, rendering: str, accepted: int, drafted: int) -> None:
    if drafted:
        tally = memory.rendering.setdefault(rendering, RenderingTally())
        tally.generations += 1
        tally.accepted += accepted
        tally.drafted += drafted


def target_ids(pair, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """The target's ids of a raw prompt (tokenized as is) or of a conversation (through its template)."""
    if messages is None:
        return pair.target_tokenizer.encode(check_prompt(prompt))
    return render_ids(pair.target_tokenizer, check_messages(messages))


def prompt_ids(pair, prompt: str | None = None, messages: list[dict] | None = None, rendering: str = "own"):
    """(target ids, drafter ids or None): a raw prompt is tokenized as is; a conversation goes through templates."""
    t_ids = target_ids(pair, prompt, messages)
    if messages is None:
        d_ids = pair.drafter_tokenizer.encode(prompt) if pair.drafter_tokenizer is not None else None
        return t_ids, d_ids
    messages = check_messages(messages)
    if pair.drafter_tokenizer is None:
        return t_ids, None
    if pair.same_tokenizer:
        return t_ids, list(t_ids)
    if rendering == "stripped":
        return t_ids, stripped_ids(pair.target_tokenizer, t_ids, pair.drafter_tokenizer)
    return t_ids, render_ids(pair.drafter_tokenizer, messages)
