"""gateway.thinking_split: reasoning taken out of generated text by its template's tags (pure).

The expected splits follow Ollama's thinking parser (thinking/parser.go and its tests): only a
block at the start counts, whitespace after either tag is dropped, a partial tag is held until
the next piece decides. Unlike Ollama's parser, what is still held at the end is given back."""

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.inventory import capabilities
from gateway.thinking_split import ThinkingSplit, think_tags


def split_all(pieces, opening="<think>", closing="</think>"):
    sp = ThinkingSplit(opening, closing)
    thinking, content = [], []
    for p in pieces:
        t, c = sp.add(p)
        thinking.append(t)
        content.append(c)
    t, c = sp.end()
    return "".join(thinking + [t]), "".join(content + [c])


def test_tags_come_from_the_template_text():
    assert think_tags("{{ '<think>' }}{{ m.reasoning }}{{ '</think>' }}") == ("<think>", "</think>")
    assert think_tags("<|START_THINKING|>x<|END_THINKING|>") == ("<|START_THINKING|>",
                                                                  "<|END_THINKING|>")
    assert think_tags("<seed:think></seed:think>") == ("<seed:think>", "</seed:think>")
    # a template that only strips earlier reasoning at the closing tag (Qwen/DeepSeek)
    assert think_tags("{% set c = m.content.split('</think>')[-1] %}") == ("<think>", "</think>")
    assert think_tags('{% set c = content.split("</think>")[-1] %}') == ("<think>", "</think>")
    # an opening tag alone names no pair; nor does a template without tags
    assert think_tags("{{ '<think>' }}") is None
    assert think_tags("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert think_tags("") is None


def test_a_tag_pair_in_the_template_gives_the_thinking_capability():
    caps = capabilities(embeddings=False, template="<|START_THINKING|>..<|END_THINKING|>",
                        has_fim=False, vision=False)
    assert caps == ["completion", "thinking"]
    assert "thinking" not in capabilities(embeddings=False, template="plain", has_fim=False,
                                          vision=False)


def test_reasoning_at_the_start_is_split_off():
    assert split_all(["<think>I should greet.</think>Hello!"]) == ("I should greet.", "Hello!")
    # whitespace before the opening tag and after either tag is dropped, inside it kept
    assert split_all(["\n <think>\n\n a b \n</think>\n\n Hi"]) == ("a b \n", "Hi")
    # token by token, tags cut anywhere
    assert split_all(["<", "th", "ink", ">", "x", "</", "thi", "nk>", "y"]) == ("x", "y")


def test_text_that_does_not_open_with_the_tag_is_all_content():
    assert split_all(["Hello <think>no</think>"]) == ("", "Hello <think>no</think>")
    # a start of the tag that turns out not to be one: nothing lost, nothing reordered
    assert split_all(["<thi", "s is it"]) == ("", "<this is it")
    assert split_all(["  <", "b>bold"]) == ("", "  <b>bold")


def test_held_text_is_given_back_at_the_end():
    sp = ThinkingSplit("<think>", "</think>")
    assert sp.add("<thi") == ("", "")  # could still be the tag
    assert sp.end() == ("", "<thi")
    sp = ThinkingSplit("<think>", "</think>")
    assert sp.add("<think>abc</th") == ("abc", "")  # a partial closing tag is held
    assert sp.end() == ("</th", "")  # unclosed reasoning stays reasoning
    sp = ThinkingSplit("<think>", "</think>")
    assert sp.add("<think>never closed") == ("never closed", "")
    assert sp.end() == ("", "")


def test_pieces_come_out_as_soon_as_they_are_decided():
    sp = ThinkingSplit("<think>", "</think>")
    assert sp.add("<think>") == ("", "")
    assert sp.add("  ") == ("", "")  # whitespace right after the tag
    assert sp.add("one ") == ("one ", "")
    assert sp.add("two<") == ("two", "")  # "<" may start the closing tag
    assert sp.add("/think>") == ("", "")
    assert sp.add("\n") == ("", "")  # whitespace right after the closing tag
    assert sp.add("Answer") == ("", "Answer")
    assert sp.add(" <think>again</think>") == ("", " <think>again</think>")
    assert "".join(sp.raw) == "<think>  one two</think>\nAnswer <think>again</think>"


def test_a_prompt_that_opened_the_reasoning():
    sp = ThinkingSplit("<think>", "</think>")
    sp.add("<think>")  # as the gateway feeds a rendered prompt's trailing tag
    assert sp.add("plan</think>answer") == ("plan", "answer")


texts = st.text(alphabet=st.sampled_from(list("<>/thinkab \n")), max_size=40)


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_any_cut_into_pieces_splits_as_the_whole(text, cuts):
    """However the worker's pieces cut the text, the split is the one of the whole text, and
    the text is the reasoning and the answer with the tags and dropped whitespace only."""
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    whole = split_all([text])
    assert split_all(pieces) == whole
    thinking, content = whole
    stripped = text.lstrip()
    if stripped.startswith("<think>") and "</think>" in stripped[7:]:
        body = stripped[7:].lstrip()
        at = body.find("</think>")
        assert (thinking, content) == (body[:at], body[at + 8:].lstrip())
    elif stripped.startswith("<think>"):
        assert content == "" and thinking == stripped[7:].lstrip()
    else:
        assert (thinking, content) == ("", text)
