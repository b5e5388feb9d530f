"""Every Python code block in README.md and docs/ runs as written.

The rules, also stated in docs/index.md ("Code on these pages"):

* A fenced block whose info string is ``python`` runs. The blocks of one
  file run in order in one namespace, as a reader pastes them into one
  session: a block may use names an earlier block of the same file defined.
  Each file runs in a fresh temporary working folder (``HOME`` and the TFDS
  data folder point there too), and the Keras dtype policy is reset after it.
* Blocks tagged ``bash``, ``console``, ``text`` or nothing are shell commands,
  diagrams or output: they are not run. The ``keras-mp`` commands of ``bash``
  blocks are parsed by the command line's own parser, so a renamed command or
  option fails here.
* A Python block that must not run here (it needs a GPU, a download or
  several machines) is preceded, on the line before its fence, by
  ``<!-- snippet: skip REASON -->``; the reason is required.

The ``>>>`` examples of keras_mp's docstrings, which the API reference pages
render, run here too (doctest, one module at a time). Tutorial notebooks are
run by tests/test_tutorials.py.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import io
import os
import re
import shlex
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\b(?P<reason>.*?)-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str
    line: int  # 1-based line of the block's first code line
    language: str
    code: str
    skip: str | None  # the reason, if marked not to run


def blocks(text: str, path: str = "<text>") -> list[Block]:
    """The fenced code blocks of ``text``, in order (indented fences too,
    e.g. inside admonitions or list items)."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        language = (m["info"].strip().split() or [""])[0].lower()
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = _SKIP.match(prev)
        if skip and not skip["reason"].strip():
            raise ValueError(f"{path}:{i}: `<!-- snippet: skip -->` needs a reason")
        body, j = [], i + 1
        while j < len(lines) and not re.match(
                rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code block never closed")
        found.append(Block(path, i + 2, language, "\n".join(body) + "\n",
                           skip["reason"].strip() if skip else None))
        i = j + 1
    return found


def _pages() -> list[Path]:
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md"))
            if "tutorials" not in p.relative_to(ROOT / "docs").parts]
    return [ROOT / "README.md", *docs]


def _python_blocks(page: Path) -> list[Block]:
    rel = str(page.relative_to(ROOT))
    return [b for b in blocks(page.read_text(), rel) if b.language in ("python", "py")]


# -- the collector itself ------------------------------------------------------

def test_collector_finds_blocks_languages_and_skip_markers():
    text = ("Intro.\n\n```python\nx = 1\n```\n\n```bash\npip install .\n```\n\n"
            "<!-- snippet: skip needs a GPU -->\n```python\nimport cupy\n```\n\n"
            "!!! note\n    ```python\n    y = x + 1\n    ```\n")
    found = blocks(text, "t.md")
    assert [(b.language, b.line, b.code, b.skip) for b in found] == [
        ("python", 4, "x = 1\n", None), ("bash", 8, "pip install .\n", None),
        ("python", 13, "import cupy\n", "needs a GPU"), ("python", 18, "y = x + 1\n", None)]
    with pytest.raises(ValueError, match="needs a reason"):
        blocks("<!-- snippet: skip -->\n```python\nx\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks("```python\nx = 1\n")


def test_pages_have_python_blocks_to_run():
    runnable = [b for page in _pages() for b in _python_blocks(page) if b.skip is None]
    assert len(runnable) >= 15, [f"{b.path}:{b.line}" for b in runnable]


def _keras_mp_commands(code: str) -> list[list[str]]:
    commands = []
    for line in code.splitlines():
        words = shlex.split(line, comments=True)
        part: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if part and part[0] == "keras-mp":
                    commands.append(part[1:])
                part = []
            else:
                part.append(word)
    return commands


def test_keras_mp_commands_in_shell_blocks_parse():
    from keras_mp.cli import command as cli

    assert _keras_mp_commands("pip install . && keras-mp demo  # c\nkeras-mp info") == [
        ["demo"], ["info"]]
    seen = 0
    for page in _pages():
        for block in blocks(page.read_text(), str(page.relative_to(ROOT))):
            if block.language not in ("bash", "sh", "shell"):
                continue
            for argv in _keras_mp_commands(block.code):
                try:
                    cli._parser().parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{block.path}:{block.line}: `keras-mp {' '.join(argv)}` "
                                "does not parse")
                seen += 1
    assert seen >= 3


# -- running the pages ----------------------------------------------------------

@pytest.mark.parametrize("page", [p for p in _pages() if _python_blocks(p)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs(page, tmp_path, monkeypatch):
    if page.name == "README.md":  # the user's first run: the measured execution mode
        monkeypatch.delenv("KERAS_MP_EXECUTION", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KERAS_MP_DATA_DIR", str(tmp_path / "tensorflow_datasets"))
    namespace: dict = {"__name__": "__snippet__"}
    try:
        for block in _python_blocks(page):
            if block.skip is not None:
                continue
            # Blank lines before the code keep the traceback's line numbers
            # those of the Markdown file.
            code = compile("\n" * (block.line - 1) + block.code, block.path, "exec")
            exec(code, namespace)  # noqa: S102 - the documentation's own code
    finally:
        keras.config.set_dtype_policy("float32")
        keras.utils.clear_session(free_memory=False)
        os.environ.pop("TF_CONFIG", None)


# -- docstring examples (the API reference) ---------------------------------------

def _modules() -> list[str]:
    """Every module of the package and of ``benchmarks/`` (installed with it as
    ``keras_mp.benchmarks``), subpackages' ``__init__`` included."""
    names = []
    for path in [*(ROOT / "keras_mp").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = io.StringIO()
    try:
        for test in doctest.DocTestFinder().find(module, name):
            runner.run(test, out=out.write)
    finally:
        keras.config.set_dtype_policy("float32")
        keras.utils.clear_session(free_memory=False)
    assert runner.failures == 0, out.getvalue()
