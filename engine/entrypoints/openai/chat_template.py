"""Chat templates: messages -> one prompt string.

GPT-2 was never trained on chat, so it has no template. The default is the plainest
transcript a base model has seen in web text, one ``Role: content`` line per message and
a trailing ``Assistant:`` for the model to continue::

    System: You are terse.
    User: Hello
    Assistant:

``--chat-template FILE`` replaces it with any Jinja template written for transformers
(``messages``, ``add_generation_prompt``, ``bos_token``, ``raise_exception`` ...); a
tokenizer that ships its own template uses that unless a file is given. Rendering goes
through the tokenizer's ``apply_chat_template`` (engine.tokenizer), in the Jinja sandbox
transformers uses.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def load_chat_template(path: str | None, tokenizer) -> str:
    """The template to serve with: the file, else the tokenizer's own, else the default."""
    if path is not None:
        text = Path(path).read_text()
        try:
            jinja2.Environment().parse(text)  # fail at startup, not on the first request
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template {path}: line {e.lineno}: {e.message}") from None
        return text
    return getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render_chat(tokenizer, template: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Raises ValueError for a template that fails on these messages (a 400, not a 500)."""
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed on these messages: {e}") from None
