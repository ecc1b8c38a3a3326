"""Every user-facing sentence is in docs/messages.md, read side by side, and keeps the rules."""

from __future__ import annotations

import re

import pytest
from message_catalogue import CATALOGUE, SURFACES, Sentence, glossary_tables, render, sentences

from jupyter_gpufrac import contract

FOUND = sentences()

# What a sentence must not say, and why.
RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("'losses' means something else to a machine-learning user: say what was not restored",
     re.compile(r"\blosse?s\b", re.IGNORECASE)),
    ("a countdown is said by its deadline, in the present tense", re.compile(r"\bWill move\b")),
    ("'Cells [a] to [b]' is said only for more than one cell",
     re.compile(r"Cells \[\{(\w+)\}\] to \[\{\1\}\]")),
    ("a space before punctuation", re.compile(r"\w \.(\s|$)| ,")),
    ("a doubled word", re.compile(r"\b([a-z]{3,}) \1\b")),
)


def test_the_catalogue_is_current() -> None:
    """A message changed without the catalogue shows here: regenerate it and read the diff."""
    assert CATALOGUE.read_text() == render(FOUND), (
        "docs/messages.md is not current: run `python tests/message_catalogue.py --write` and "
        "read the diff side by side")


@pytest.mark.parametrize("why,pattern", RULES, ids=[why.split(":")[0][:40] for why, _ in RULES])
def test_no_sentence_breaks_a_wording_rule(why: str, pattern: re.Pattern[str]) -> None:
    broken = [f"{s.path} {s.producer}: {s.text}" for s in FOUND if pattern.search(s.text)]
    assert not broken, why + ":\n" + "\n".join(broken)


def test_simulated_is_said_once_per_sentence_a_notebook_user_reads() -> None:
    notebook = {SURFACES[0][0], SURFACES[-1][0]}
    broken = [f"{s.path}: {s.text}" for s in FOUND
              if s.surface in notebook and s.text.lower().count("simulated") > 1]
    assert not broken, broken


def test_every_event_kind_names_the_sentences_it_produces() -> None:
    """An event the server emits whose sentence the catalogue cannot attribute would be read
    without knowing when it appears."""
    attributed = {kind for s in FOUND for kind in re.findall(r"`(\w+)`", s.producer)}
    assert set(contract.EVENT_KINDS) <= attributed, set(contract.EVENT_KINDS) - attributed


def test_each_surface_is_read() -> None:
    """The extraction finds every surface's prose (a broken pattern would empty one silently)."""
    by_surface = {surface: [s for s in FOUND if s.surface == surface] for surface, _ in SURFACES}
    assert all(len(found) >= 20 for found in by_surface.values()), {
        surface: len(found) for surface, found in by_surface.items()}
    # The frontend's sentences are read from trans calls, joined across lines and plurals.
    frontend = {s.text for s in by_surface[SURFACES[-1][0]]}
    assert any("%1" in text for text in frontend)


def test_the_extraction_reads_what_users_read_and_skips_logs_and_docstrings() -> None:
    """On a module written for the purpose: f-strings keep their fields, log lines, docstrings
    and --help texts are not messages, an emitted message is attributed to its event."""
    import ast

    from message_catalogue import _PythonSentences

    source = '''
"""A module docstring with many words in it."""
def shrink(log, events, kid, name):
    """A docstring with many words in it."""
    log.info("a log line for operators only %s", kid)
    parser.add_argument("--x", help="a help text for the reference")
    message = f"Asked to give back {name} of loaned memory."
    events.emit(kid, "shrink_requested", message)
    print(f"gpufrac: {name} is not what you think")
'''
    visitor = _PythonSentences("kernel", "m.py")
    visitor.visit(ast.parse(source))
    assert visitor.found == [
        Sentence("kernel", "m.py", "shrink → `shrink_requested`",
                 "Asked to give back {name} of loaned memory."),
        Sentence("kernel", "m.py", "shrink → `shrink_requested`",
                 "gpufrac: {name} is not what you think"),
    ]


# --- the glossary (docs/glossary.md): one word for each thing, on every surface -------------


def test_the_glossary_says_the_words_the_code_uses() -> None:
    """The states, protections and sources people read are the ones the code shows (the
    frontend reads the generated copy of the contract's)."""
    from node_agent import words

    kernel_states, lease_states = glossary_tables("States")
    assert {state: word for word, state, _ in kernel_states} == dict(contract.KERNEL_STATE_WORDS)
    assert {state: word for word, state in lease_states} == dict(words.LEASE_STATE_WORDS)
    [protections] = glossary_tables("Protections")
    assert {word for word, _ in protections} == {words.FROZEN_IN_HOST_MEMORY,
                                                 words.CHECKPOINT_ON_DISK}
    [sources] = glossary_tables("Sources")
    assert {source: word for word, source in sources} == dict(contract.SOURCE_WORDS)


def test_no_sentence_uses_a_word_the_glossary_replaces() -> None:
    [banned] = glossary_tables("Words we do not use")
    broken = []
    for pattern, instead, _ in banned:
        for s in FOUND:
            if re.search(pattern, s.text):
                broken.append(f"{s.path} {s.producer}: {s.text!r} (say {instead!r})")
    assert not broken, "\n".join(broken)


def test_jupyterlab_shows_no_markdown() -> None:
    """The frontend's own words carry no literal Markdown; the server's commands in backticks
    are shown as code in the panel and plainly in notifications (words.ts)."""
    frontend = SURFACES[-1][0]
    marked = [f"{s.path} {s.producer}: {s.text}" for s in FOUND
              if s.surface == frontend and re.search(r"`|\*\*|\]\(", s.text)]
    assert not marked, marked
