"""Chat messages -> prompt token ids, with the checkpoint's own chat template when it has one.

The template is the ``chat_template`` string of ``tokenizer_config.json``,
rendered like Hugging Face's ``apply_chat_template`` (sandboxed jinja2 with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, special tokens as
variables) and tokenized without adding special tokens, because the template
writes them itself. A checkpoint without a template gets the documented
default (docs/server.md): one ``"{role}: {content}\\n"`` line per message, then
``"assistant:"``, tokenized with the tokenizer's usual special tokens (BOS).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from dspark.server.protocol.openai_schema import APIError, ChatMessage


class ChatTemplate:
    def __init__(self, source: str | None, special_tokens: dict[str, str]) -> None:
        self.source = source  # None = the default template
        self.special_tokens = special_tokens
        self._render: Callable[..., str] | None = None
        if source is not None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._render = env.from_string(source).render

    @classmethod
    def from_checkpoint(cls, root: Path) -> ChatTemplate:
        """From the directory's tokenizer_config.json, or a GGUF file's metadata (tokenizer.chat_template)."""
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        if root.is_file() and root.suffix.lower() == ".gguf":
            from dspark.llm.gguf import read_tokenizer_config

            cfg = read_tokenizer_config(root)
        special = {k: v if isinstance(v, str) else v.get("content", "") for k, v in cfg.items()
                   if k.endswith("_token") and isinstance(v, str | dict)}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # the named-templates form: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(template if isinstance(template, str) else None, special)

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the tokenizer should add BOS etc. (only for the default template)."""
        return self._render is None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if self._render is None:
            lines = "".join(f"{m.role}: {m.text()}\n" for m in messages)
            return lines + ("assistant:" if add_generation_prompt else "")
        import jinja2

        msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
        try:
            return self._render(messages=msgs, add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:  # it refused these messages
            raise APIError(400, f"chat template: {e}", param="messages") from None
