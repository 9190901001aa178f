"""The prompts of a run rendered to ``input_ids``: the run's tokenizer (``core.tokenizer``),
with its rows' errors told as rejections and its batches of prompts without tools rendered
the cheap way (`_DirectRenderer`)."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.tokenizer import RunTokenizer
from producer.rows import Prompt, RowError


class Templater(RunTokenizer):
    """Renders prompts to ``input_ids`` exactly as ``apply_chat_template`` does."""

    def __init__(
        self,
        tokenizer_path: Path,
        *,
        trust_remote_code: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        family: str | None = None,
    ) -> None:
        super().__init__(
            tokenizer_path,
            trust_remote_code=trust_remote_code,
            template_kwargs=template_kwargs,
            family=family,
        )
        _flatten_template_globals(self.tokenizer.chat_template)
        self._direct = _DirectRenderer.of(self.tokenizer, self.template_kwargs)
        if self._direct is not None and not self._direct_render_agrees():
            self._direct = None

    @property
    def renders_directly(self) -> bool:
        """Whether prompts without tools skip apply_chat_template (see `_DirectRenderer`)."""
        return self._direct is not None

    def render(self, prompt: Prompt) -> str:
        """The prompt text the template produces, ending with the generation prompt."""
        try:
            return self.render_chat(prompt.messages, prompt.tools, add_generation_prompt=True)
        except Exception as exc:  # jinja raises many types; any of them rejects the row
            raise RowError("template_error", f"{type(exc).__name__}: {exc}") from exc

    def render_many(self, prompts: Sequence[Prompt]) -> list[str | RowError]:
        """Render prompts; those without tools in one call, as transformers batches them."""
        out: list[str | RowError] = [""] * len(prompts)
        plain = [i for i, p in enumerate(prompts) if p.tools is None]
        try:
            texts = self._render_plain([prompts[i].messages for i in plain]) if plain else []
        except Exception:  # one bad row fails the batch: render one by one to find it
            texts, plain = [], []
        for i, text in zip(plain, texts, strict=True):
            out[i] = str(text)
        for i in sorted(set(range(len(prompts))) - set(plain)):
            out[i] = self._render_or_error(prompts[i])
        return out

    def _render_plain(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        """Render conversations without tools as apply_chat_template(tokenize=False) does."""
        if self._direct is not None:
            return self._direct(conversations)
        return self.render_chats(conversations, add_generation_prompt=True)

    def _direct_render_agrees(self) -> bool:
        """Whether `_DirectRenderer` renders these probes as apply_chat_template does."""
        probes: list[list[dict[str, Any]]] = [
            [{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
                {"role": "user", "content": "bye"},
            ],
            [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "weather", "arguments": {"city": "Paris"}},
                        }
                    ],
                },
                {"role": "tool", "content": "sunny"},
            ],
        ]
        try:
            direct = self._render_plain(probes)
        except Exception:  # e.g. a template that needs what only apply_chat_template passes
            return False
        saved, self._direct = self._direct, None
        try:
            return direct == self._render_plain(probes)
        except Exception:
            return False
        finally:
            self._direct = saved

    def _render_or_error(self, prompt: Prompt) -> str | RowError:
        try:
            return self.render(prompt)
        except RowError as err:
            return err


class _DirectRenderer:
    """Renders conversations without tools as apply_chat_template(tokenize=False), cheaper.

    What apply_chat_template does to such a conversation (transformers 4.49 and later):
    drop None-valued message keys, copy it into plain JSON types, copy reasoning fields
    under their other names, then render the compiled template with these arguments. Rows
    from `producer.rows` are plain JSON without None values, so for a conversation without
    reasoning fields the first three steps change nothing, and this renders the compiled
    template directly (BENCHMARKS.md, "Render"). One with reasoning fields
    goes through transformers' render_jinja_template. The Templater checks at load time
    that this renders as apply_chat_template does, and uses that where it does not.
    """

    def __init__(self, template: str, compiled: Any, render_jinja: Any, kwargs: Any) -> None:
        self._template = template
        self._compiled = compiled
        self._render_jinja = render_jinja
        self._kwargs = kwargs

    @classmethod
    def of(cls, tokenizer: Any, template_kwargs: dict[str, Any]) -> _DirectRenderer | None:
        """The renderer of this tokenizer's template, if this transformers has the parts."""
        try:
            from transformers.utils.chat_template_utils import (
                _compile_jinja_template,
                _plain_template_data,
                render_jinja_template,
            )
        except ImportError:
            return None
        template = tokenizer.get_chat_template(None, None)
        try:
            compiled = _compile_jinja_template(template)
        except Exception:  # a broken template: apply_chat_template says why, row by row
            return None
        kwargs = _plain_template_data({**tokenizer.special_tokens_map, **template_kwargs})
        return cls(template, compiled, render_jinja_template, kwargs)

    def __call__(self, conversations: list[list[dict[str, Any]]]) -> list[str]:
        return [self._render(messages) for messages in conversations]

    def _render(self, messages: list[dict[str, Any]]) -> str:
        if any(field in message for message in messages for field in _REASONING_FIELDS):
            rendered, _ = self._render_jinja(
                conversations=[messages],
                chat_template=self._template,
                add_generation_prompt=True,
                **self._kwargs,
            )
            return str(rendered[0])
        return str(
            self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self._kwargs,
            )
        )


# The message fields transformers copies under each other's names before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _flatten_template_globals(chat_template: str | dict[str, str]) -> None:
    """Make the globals of each compiled chat template a plain dict.

    Jinja builds every render's context by copying the template's globals, a ChainMap over
    the environment's that it iterates in Python: a third of rendering a short prompt. A dict
    with the same entries looks up the same values and copies in C. transformers caches the
    compiled template, so its own apply_chat_template then renders with the flat globals;
    where its private cache is not there, rendering is only slower.
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    for text in texts:
        try:
            compiled = _compile_jinja_template(text)
        except Exception:  # a broken template: every row will say why (template_error)
            continue
        if isinstance(compiled.globals, ChainMap):
            compiled.globals = dict(compiled.globals)
