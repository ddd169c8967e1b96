"""The tested matrix the docs show is the one ``noxfile.py`` runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "_generated" / "matrix.md"


def test_the_docs_matrix_is_generated_from_the_noxfile() -> None:
    """The docs' and the README's tables are noxfile.render_matrix() (UPDATE_MATRIX_DOC=1)."""
    pytest.importorskip("nox")
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    table = noxfile.render_matrix()
    readme = (ROOT / "README.md").read_text()
    head, rest = readme.split("<!-- matrix -->\n", 1)
    _, tail = rest.split("<!-- /matrix -->", 1)
    if os.environ.get("UPDATE_MATRIX_DOC") == "1":
        TABLE.write_text(table)
        (ROOT / "README.md").write_text(f"{head}<!-- matrix -->\n{table}<!-- /matrix -->{tail}")
        readme = (ROOT / "README.md").read_text()
    assert TABLE.read_text() == table
    assert f"<!-- matrix -->\n{table}<!-- /matrix -->" in readme
