"""Griffe extension for the API reference: docstrings as keras-mp writes them.

Two conventions of keras-mp's docstrings that griffe's Google parser does not
read as meant:

* doctests introduced by ``Example:`` (or ``Example, with fit:``), which
  griffe treats as an admonition whose body is Markdown: ``>>>`` lines would
  render as nested block quotes and outputs such as ``[0, 0]`` as broken link
  references. Every run of doctest lines (a ``>>>`` line, its continuations
  and output, up to a blank line or a dedent) is fenced as ``pycon``, without
  its ``# doctest:`` directives (for the test runner, not the reader);
* several parameters documented on one line (``x, bias: as for ...``),
  which griffe reports as an unknown parameter: each gets its own line.
"""

from __future__ import annotations

import re

from griffe import Extension, Object

_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")
_GROUPED = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)+):(\s.*)$")


def fence_doctests(text: str) -> str:
    """Returns ``text`` with every doctest block fenced as ``pycon``.

    Example:
        >>> fence_doctests("Example:\\n    >>> 1 + 1\\n    2").splitlines()
        ['Example:', '', '    ```pycon', '    >>> 1 + 1', '    2', '    ```']
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(_DIRECTIVE.sub("", lines[i]))
            i += 1
        if out and out[-1].strip():
            out.append("")  # a fence must not continue the paragraph above
        out += [indent + "```pycon", *block, indent + "```", ""]
    return "\n".join(out)


def split_grouped_parameters(text: str) -> str:
    """Gives each parameter of an ``Args:`` line ``a, b: text`` its own line.

    Example:
        >>> split_grouped_parameters("Args:\\n    a, b: the inputs.").splitlines()
        ['Args:', '    a: the inputs.', '    b: the inputs.']
    """
    out: list[str] = []
    in_args = False
    header_indent = 0
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if line.strip() in _ARGS_HEADERS:
            in_args, header_indent = True, indent
        elif line.strip() and indent <= header_indent:
            in_args = False
        match = _GROUPED.match(line) if in_args else None
        if match:
            lead, names, rest = match.groups()
            out += [f"{lead}{name.strip()}:{rest}" for name in names.split(",")]
        else:
            out.append(line)
    return "\n".join(out)


class DoctestBlocks(Extension):
    """Applies both rewrites to every docstring griffe loads."""

    def on_instance(self, *, obj: Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_grouped_parameters(fence_doctests(obj.docstring.value))
