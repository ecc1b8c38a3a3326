"""Every user-facing sentence of the kernel, server, agent and frontend, found in the source.

``python tests/message_catalogue.py --write`` regenerates docs/messages.md, where they are read
side by side, each with what produces it (the function, and the event kind for server events);
tests/test_message_catalogue.py fails while that file is not current, and checks the wording
rules on every sentence.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CATALOGUE = REPO / "docs" / "messages.md"

# Where each surface's sentences come from.
SURFACES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel (`%gpu`, cell output)", ("jupyter_gpufrac/kernel",)),
    ("server (events, REST reasons, notifications' text)",
     ("jupyter_gpufrac/server", "jupyter_gpufrac/checkpoint_disk.py")),
    ("agent and `gpufrac-agent` (reasons, terminal)", ("node_agent",)),
    ("JupyterLab (status bar, panel, notifications)", ("labextension/src",)),
)

# Calls whose string arguments are for operators' logs or reference help, not for the user
# reading what happened.
# Operators' reports (the trace simulator, Prometheus help), not what happened to a notebook.
_NOT_USER_FACING = ("node_agent/simulator/", "node_agent/metrics.py")
_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical"})
_HELP_KEYWORDS = frozenset({"help", "description", "epilog", "metavar", "usage"})
_NOT_PROSE = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|ALTER|PRAGMA|WITH)\b|"
                        r"^[\w.:/%{}\[\]-]*$")
_WORD = re.compile(r"[A-Za-z]{2,}")


@dataclass(frozen=True)
class Sentence:
    """One user-facing text as written (placeholders as ``{expression}``), and its producer."""

    surface: str
    path: str
    producer: str
    text: str


def _is_prose(text: str) -> bool:
    return len(_WORD.findall(text)) >= 3 and " " in text.strip() and not _NOT_PROSE.match(text)


def _render(node: ast.expr) -> str:
    """A literal as the user reads it: an f-string's fields shown as ``{expression}``."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    parts = []
    for value in node.values:  # type: ignore[attr-defined]
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
        else:
            # Its format too (":.2f"): how a figure is said is part of the sentence.
            spec = value.format_spec
            said = ":" + _render(spec) if isinstance(spec, ast.JoinedStr) else ""
            parts.append("{" + ast.unparse(value.value) + said + "}")
    return "".join(parts)


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _emitted(node: ast.AST) -> str | None:
    """The event kind of ``events.emit(kernel_id, "kind", message, ...)``."""
    if (isinstance(node, ast.Call) and _called(node) == "emit" and len(node.args) >= 3
            and isinstance(node.args[1], ast.Constant)):
        return str(node.args[1].value)
    return None


def _feeds(module: ast.Module) -> dict[str, set[str]]:
    """Functions whose text an event carries though they do not emit it: called in the message
    argument, or in what was assigned to it in the emitting function."""
    feeds: dict[str, set[str]] = {}
    for function in ast.walk(module):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for call in ast.walk(function):
            if not (kind := _emitted(call)):
                continue
            assert isinstance(call, ast.Call)
            message = ast.unparse(call.args[2])
            sources: list[ast.AST] = [call.args[2]] + [
                a.value for a in ast.walk(function) if isinstance(a, ast.Assign)
                and any(ast.unparse(t) == message for t in a.targets)]
            for source in sources:
                for inner in ast.walk(source):
                    if isinstance(inner, ast.Call):
                        feeds.setdefault(_called(inner), set()).add(kind)
    return feeds


class _PythonSentences(ast.NodeVisitor):
    def __init__(self, surface: str, path: str) -> None:
        self.surface, self.path = surface, path
        self.scope: list[str] = []
        self.event: list[str] = []
        self.found: list[Sentence] = []
        self.feeds: dict[str, set[str]] = {}

    def _docstring_free(self, node: ast.AST) -> None:
        body = getattr(node, "body", [])
        start = 1 if (body and isinstance(body[0], ast.Expr)
                      and isinstance(body[0].value, ast.Constant)
                      and isinstance(body[0].value.value, str)) else 0
        for child in body[start:]:
            self.visit(child)
        for field in ("decorator_list", "args", "returns", "bases", "keywords"):
            value = getattr(node, field, None)
            for child in value if isinstance(value, list) else [value] if value else []:
                self.visit(child)

    def visit_Module(self, node: ast.Module) -> None:
        self.feeds = _feeds(node)
        self._docstring_free(node)

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        # A message built first and emitted after: the function's events produce it.
        kinds = [] if isinstance(node, ast.ClassDef) else sorted(
            {kind for call in ast.walk(node) if (kind := _emitted(call))}
            | self.feeds.get(node.name, set()))
        self.event.append(", ".join(f"`{kind}`" for kind in kinds))
        self._docstring_free(node)
        self.event.pop()
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = _called(node)
        if name in _LOG_METHODS and isinstance(func, ast.Attribute):
            return  # a log line, for operators
        self.visit(func)
        event = f"`{kind}`" if (kind := _emitted(node)) else None
        if event:
            self.event.append(event)
        for arg in node.args:
            self.visit(arg)
        for keyword in node.keywords:
            if keyword.arg not in _HELP_KEYWORDS:
                self.visit(keyword.value)
        if event:
            self.event.pop()

    def _literal(self, node: ast.Constant | ast.JoinedStr) -> None:
        if isinstance(node, ast.Constant) and not isinstance(node.value, str):
            return
        text = _render(node)
        if _is_prose(text):
            producer = ".".join(self.scope) or "(module)"
            if self.event and self.event[-1]:
                producer += f" → {self.event[-1]}"
            self.found.append(Sentence(self.surface, self.path, producer, text))

    visit_Constant = visit_JoinedStr = _literal  # type: ignore[assignment]


# trans.__('…') and trans._n('…', '…', n): single-quoted pieces, joined by + across lines.
_TS_CALL = re.compile(r"\b(?:__|_n)\(\s*((?:'(?:[^'\\\n]|\\.)*'\s*\+?\s*,?\s*)+)")
_TS_PIECE = re.compile(r"'((?:[^'\\\n]|\\.)*)'")
_TS_ARGS = re.compile(r"(?<=')\s*,\s*(?=')")
_TS_SCOPE = re.compile(r"^\s*(?:export\s+)?(?:async\s+)?(?:function\s+(\w+)|"
                       r"(?:private\s+|protected\s+|public\s+|static\s+)*(\w+)\s*\([^;]*\)"
                       r"\s*(?::[^=;]*)?\{\s*$)")


def _ts_sentences(surface: str, path: Path) -> Iterator[Sentence]:
    source = path.read_text()
    scopes = [(m.start(), m.group(1) or m.group(2))
              for m in re.finditer(_TS_SCOPE.pattern, source, re.MULTILINE)
              if (m.group(1) or m.group(2)) not in {"if", "for", "while", "switch", "catch"}]
    rel = str(path.relative_to(REPO))
    for call in _TS_CALL.finditer(source):
        producer = next((name for at, name in reversed(scopes) if at < call.start()), "(module)")
        # Pieces joined by + make one text; a comma starts the next (_n's plural).
        for argument in _TS_ARGS.split(call.group(1)):
            text = "".join(_TS_PIECE.findall(argument)).replace("\\'", "'")
            if _is_prose(text):
                yield Sentence(surface, rel, producer, text)


def sentences() -> list[Sentence]:
    """Every user-facing sentence, in the order of the surfaces, files and source."""
    found: list[Sentence] = []
    for surface, roots in SURFACES:
        for root in roots:
            base = REPO / root
            files = [base] if base.is_file() else sorted(base.rglob("*.py" if "labextension"
                                                                     not in root else "*.ts"))
            for path in files:
                if str(path.relative_to(REPO)).startswith(_NOT_USER_FACING):
                    continue
                if path.suffix == ".ts":
                    found.extend(_ts_sentences(surface, path))
                    continue
                visitor = _PythonSentences(surface, str(path.relative_to(REPO)))
                visitor.visit(ast.parse(path.read_text(), str(path)))
                found.extend(visitor.found)
    return found


def render(found: list[Sentence]) -> str:
    """docs/messages.md: a section per surface, a table per file."""
    lines = [
        "# What the user reads",
        "",
        "Every user-facing sentence of jupyter-gpufrac, found in the source by",
        "`tests/message_catalogue.py` (placeholders as `{expression}`), with what produces it.",
        "Regenerate with `python tests/message_catalogue.py --write` after changing a message;",
        "`tests/test_message_catalogue.py` fails while this file is not current and checks the",
        "wording rules (see there) on every sentence. Log lines and `--help` texts are not here.",
    ]
    surface = path = None
    for item in found:
        if item.surface != surface:
            surface, path = item.surface, None
            lines += ["", f"## {surface}"]
        if item.path != path:
            path = item.path
            lines += ["", f"### `{path}`", "", "| produced by | sentence |", "|---|---|"]
        text = item.text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎")
        lines.append(f"| {item.producer} | {text} |")
    return "\n".join(lines) + "\n"


GLOSSARY = REPO / "docs" / "glossary.md"


def glossary_tables(section: str) -> list[list[list[str]]]:
    """The tables of a section of docs/glossary.md: rows of cells, each table's header and
    rule left out; a cell's code span unwrapped, an escaped ``\\|`` read as ``|``."""
    text = GLOSSARY.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    tables: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*text[start:end if end > 0 else None].splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append([c[1:-1] if c.startswith("`") and c.endswith("`") else c
                         for c in cells])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def main(argv: list[str]) -> int:
    text = render(sentences())
    if argv[1:] == ["--write"]:
        CATALOGUE.write_text(text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
