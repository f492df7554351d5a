"""A model's reasoning split from its answer by the tags its chat template writes, as Ollama
splits the text of a worker that does not (thinking/parser.go, thinking/chat_template.go).

llama-server's ``/completion`` returns the generated text as it is, and its
``/v1/chat/completions`` moves reasoning into ``reasoning_content`` only for the template
formats it recognises (a plain ChatML template that writes ``<think>`` is not one of them).
Ollama answers ``thinking`` apart from ``response`` / ``message.content`` whenever ``think`` is
on and the template names a tag pair; :class:`ThinkingSplit` does that on the gateway's side.
"""

from __future__ import annotations

from functools import lru_cache

#: Tag pairs a chat template can write reasoning between, first match wins (Ollama's table in
#: thinking/chat_template.go: DeepSeek/Qwen ``<think>``, Gemma-style channels, Command R7B,
#: Seed-OSS).
TAG_PAIRS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<|channel>", "<channel|>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<seed:think>", "</seed:think>"),
)


@lru_cache(maxsize=64)
def think_tags(template: str) -> tuple[str, str] | None:
    """The (opening, closing) reasoning tags ``template`` (a Jinja chat template's text) writes,
    or None. Both halves must appear in it; a template that only splits earlier assistant
    messages at the closing tag (``content.split('</think>')``, some Qwen/DeepSeek ones) counts
    too, as in Ollama's ``InferTagsFromChatTemplate``."""
    for opening, closing in TAG_PAIRS:
        if opening in template and closing in template:
            return opening, closing
    for opening, closing in TAG_PAIRS:
        if f"content.split('{closing}')" in template or f'content.split("{closing}")' in template:
            return opening, closing
    return None


_LOOKING, _OPENED, _THINKING, _CLOSED, _DONE = range(5)


class ThinkingSplit:
    """Streaming split of generated text into (thinking, content) pieces.

    Only a reasoning block at the very start counts: leading whitespace is skipped, text that
    cannot begin the opening tag ends the search and everything is content. Whitespace right
    after either tag is dropped. Text that may be the start of a tag is held until the next
    piece decides; :meth:`end` gives back what is still held, so no generated text is lost
    (Ollama's parser drops it). ``raw`` keeps every piece as generated, tags included, for
    ``/api/generate``'s ``context`` (Ollama tokenizes the unsplit text).
    """

    def __init__(self, opening: str, closing: str) -> None:
        self.opening, self.closing = opening, closing
        self.state = _LOOKING
        self.held = ""
        self.raw: list[str] = []

    def add(self, text: str) -> tuple[str, str]:
        """Take the next generated piece; returns the (thinking, content) it completes."""
        self.raw.append(text)
        self.held += text
        thinking: list[str] = []
        content: list[str] = []
        while self._step(thinking, content):
            pass
        return "".join(thinking), "".join(content)

    def untouched(self) -> bool:
        """Whether no generated text was given to it yet (a prompt's opening tag aside)."""
        return not self.raw

    def end(self) -> tuple[str, str]:
        """The text still held at the end of the generation as (thinking, content): a partial
        closing tag inside the reasoning is reasoning, anything else is content."""
        held, self.held = self.held, ""
        if self.state in (_OPENED, _THINKING):
            return held, ""
        return "", held

    def _step(self, thinking: list[str], content: list[str]) -> bool:
        """One transition; True when another may follow on what is held."""
        if self.state == _LOOKING:
            text = self.held.lstrip()
            if text.startswith(self.opening):
                self.held = text[len(self.opening):].lstrip()
                self.state = _THINKING if self.held else _OPENED
                return True
            if self.opening.startswith(text):  # empty, or a start of the tag: wait
                return False
            content.append(self.held)
            self.held, self.state = "", _DONE
            return False
        if self.state == _OPENED:
            self.held = self.held.lstrip()
            if not self.held:
                return False
            self.state = _THINKING
            return True
        if self.state == _THINKING:
            at = self.held.find(self.closing)
            if at >= 0:
                thinking.append(self.held[:at])
                rest = self.held[at + len(self.closing):].lstrip()
                self.held = ""
                self.state = _DONE if rest else _CLOSED
                content.append(rest)
                return False
            keep = _tag_start_at_end(self.held, self.closing)
            thinking.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return False
        if self.state == _CLOSED:
            rest, self.held = self.held.lstrip(), ""
            if rest:
                self.state = _DONE
                content.append(rest)
            return False
        content.append(self.held)
        self.held = ""
        return False


def _tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
