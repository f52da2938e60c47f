"""Sphinx configuration of the API reference, built from the docstrings.

    python -m sphinx -W -q -b html docs/api build/api

Run from the repository root (or with the package installed); warnings are errors.
"""
import os
import re
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from collectives import __version__  # noqa: E402

project = "horovod-spark"
author = "the horovod-spark authors"
copyright = "the horovod-spark authors, Apache-2.0"
release = version = __version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "literal"  # the docstrings write `name` for code, as Markdown does
html_theme = "alabaster"
html_title = f"horovod-spark {release}"
exclude_patterns = ["_build"]


# The docstrings are written to read well in help() and an editor: an example is an
# indented block after a blank line, `*args` and `np_` appear bare.  Before napoleon reads
# the Google sections, such a block becomes a literal block, and outside literals and
# backquotes the characters that reStructuredText would take as markup are escaped.
_MARKUP = re.compile(r"(``[^`]*``|`[^`]*`)|(\*{1,2}(?=\w))|(\b\w+_\b)")


def _escape(line: str) -> str:
    def one(m: "re.Match") -> str:
        if m.group(1):
            return m.group(1)
        if m.group(2):
            return "\\" + m.group(2) if len(m.group(2)) == 1 else "\\*\\*"
        return m.group(3)[:-1] + "\\_"
    return _MARKUP.sub(one, line)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Keyword Args|Returns|Return|Raises|Yields|"
                      r"Attributes|Example|Examples|Note|Notes|Warning|Warnings|See Also):\s*$")


def _literal_examples(app, what, name, obj, options, lines):
    out, literal, section = [], None, None
    for i, line in enumerate(lines):
        blank = not line.strip()
        if section is not None and not blank and _indent(line) <= section:
            section = None
        if literal is not None and not blank and _indent(line) <= literal:
            literal = None
        if _SECTION.match(line):  # napoleon's: it escapes its own parameter names
            section = _indent(line)
            if i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) <= section:
                out.extend([line, ""])  # a heading over plain paragraphs, not a section body
                continue
        elif (section is None and literal is None and not blank and i > 0
              and not lines[i - 1].strip() and _indent(line) > 0):
            literal = 0
            out[-1:] = ["", "::", ""]
        out.append(line if literal is not None or section is not None else _escape(line))
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _literal_examples, priority=100)
