"""Tokenizer handling: loading, chat templates, duplicate-BOS repair, incremental detokenizing
and stop strings that span token boundaries."""

from __future__ import annotations

import logging
import os
from typing import Any

from steadylm.errors import ModelLoadError, RequestError

logger = logging.getLogger("steadylm")


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model directory or GGUF file (its metadata holds one)."""
    from transformers import AutoTokenizer

    from steadylm import gguf_file
    from steadylm.config import check_model_path

    check_model_path(path)
    gguf_path = gguf_file.find_gguf(path)
    if gguf_path is not None:
        return gguf_file.load_tokenizer(gguf_path)
    if not any(
        os.path.isfile(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    ):
        raise ModelLoadError(
            f"no tokenizer in {path}: expected tokenizer.json or tokenizer.model "
            "(pass token ids instead, or copy the tokenizer files next to config.json)"
        )
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc


# For tokenizers without a chat template: the messages' contents, one per line.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if not loop.first %}\n{% endif %}{{ m['content'] }}{% endfor %}"
)


class PromptEncoder:
    """Turns str / message lists into token ids, with the model's chat template. A template
    that writes BOS as text plus a tokenizer that adds BOS gives two BOS tokens; one is dropped
    and that is logged once per encoder, not once per request."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        formatter: Any = None,
        meta_instruction: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.formatter = formatter  # (messages, add_generation_prompt) -> text, or None
        self.meta_instruction = meta_instruction  # a default system message
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.duplicate_bos_fixed = 0
        self.plain_template_used = False

    def encode_text(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of `text`. Text the tokenizer cannot take (a lone UTF-16 surrogate, for
        one) is the request's error, never the server's."""
        if not isinstance(text, str):
            raise RequestError(f"{param} must be a string", param=param)
        if has_surrogates(text):
            raise RequestError(
                f"{param} contains a lone UTF-16 surrogate, which is not valid Unicode text",
                param=param,
            )
        try:
            ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:
            raise RequestError(f"the tokenizer cannot encode {param}: {exc}", param=param) from exc
        return self._dedupe_bos(ids)

    def encode_messages(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the chat template. `continue_final_message`
        leaves the last (assistant) message open for the model to continue; `template_kwargs`
        reach the template as variables (vLLM's chat_template_kwargs, e.g. enable_thinking);
        `tools` (OpenAI's function definitions) reach it as `tools`."""
        _check_messages(messages)
        if self.formatter is not None:
            try:
                text = self.formatter(messages, add_generation_prompt)
            except Exception as exc:
                raise RequestError(
                    f"the chat template failed on these messages: {exc}", param="messages"
                ) from exc
            return self.encode_text(text, param="messages")
        if self.meta_instruction is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.meta_instruction}, *messages]
        template = self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            if not self.plain_template_used:
                logger.warning(
                    "the tokenizer has no chat template; joining message contents "
                    "with newlines (pass chat_template_config to set one)"
                )
            self.plain_template_used = True
            template = PLAIN_TEMPLATE
        try:
            extra = dict(template_kwargs or {})
            if tools:
                extra["tools"] = tools
            if continue_final_message:
                extra["continue_final_message"] = True
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                **extra,
            )
        except Exception as exc:  # a template that raises on these messages
            raise RequestError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from exc
        return self.encode_text(text, param="messages")

    def _dedupe_bos(self, ids: list[int]) -> list[int]:
        if self.bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == self.bos_id:
            if not self.duplicate_bos_fixed:
                logger.warning(
                    "the prompt starts with BOS twice (the chat template writes BOS and the "
                    "tokenizer adds it again); dropping one. Logged once."
                )
            self.duplicate_bos_fixed += 1
            return ids[1:]
        return ids


def has_surrogates(text: str) -> bool:
    """Whether `text` holds a UTF-16 surrogate code point (JSON's "\\ud800" parses to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages must be a non-empty list of {role, content} dicts", param="messages"
        )
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(
                f"each message needs 'role' and 'content'; got {m!r}", param="messages"
            )


class IncrementalDetokenizer:
    """Streams text deltas that never end in a broken UTF-8 character and whose concatenation
    equals the final text. Stop strings are matched on text, so they may span tokens."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop  # the output keeps the stop string that ended it
        self.kw = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:
            self.kw["spaces_between_special_tokens"] = False
        # Start from the prompt's last few tokens so a leading space decodes correctly.
        self.ids = list(prompt_ids[-4:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.stop = [s for s in (stop or []) if s]
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        try:
            return self.tokenizer.decode(ids, **self.kw)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=self.kw["skip_special_tokens"])

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Feed new tokens; return the new text (possibly empty). With stop strings, the last
        len(stop) - 1 characters are held back until they cannot start a stop string, so the
        streamed text always equals the final text. Pass final=True on the last call."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) > len(before) and (final or not full.endswith("\ufffd")):
            self.text += full[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self._emit(final)

    def _emit(self, final: bool) -> str:
        longest = max((len(s) for s in self.stop), default=0)
        if self.stop:
            start = max(0, self.emitted - longest)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                at, stop = min(hits)
                self.text = self.text[: at + (len(stop) if self.include_stop else 0)]
                self.stopped = final = True
                self.stop_hit = stop
        hold = 0 if final else max(0, longest - 1)
        end = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
