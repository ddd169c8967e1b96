"""Sphinx configuration of the celery-unique documentation (Markdown via MyST)."""

from __future__ import annotations

import re
from pathlib import Path

# Read, not imported: the version's one source is the package's __version__.
_init = (Path(__file__).parent.parent / "celery_unique" / "__init__.py").read_text()
_version = re.search(r'^__version__\s*=\s*"([^"]+)"', _init, re.MULTILINE)

project = "celery-unique"
author = "celery-unique developers"
copyright = "celery-unique developers"
release = _version.group(1) if _version else "0+unknown"
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "_tools",
    "_generated",
    "**/*.json",
    "*.json",
    "Thumbs.db",
    ".DS_Store",
]
language = "en"
nitpicky = False

myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
# Give headings anchors so that [text](page.md#some-heading) links resolve.
myst_heading_anchors = 3

autodoc_typehints = "description"
# Members inherited from Celery carry Celery's own Sphinx roles: document ours only.
autodoc_inherit_docstrings = False

html_theme = "furo"
html_title = f"celery-unique {release}"
