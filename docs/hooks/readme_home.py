"""MkDocs hook: the site's home page is README.md itself, so the front door and the site's home cannot drift
apart. README links to pages as ``docs/page.md``; on the site those pages sit beside the home page, so the
prefix is dropped. (This directory is excluded from the site: ``exclude_docs`` in mkdocs.yml.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[2] / "README.md"
_DOCS_LINK = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    if files.get_file_from_path("index.md") is not None:
        raise ValueError("docs/index.md exists, but the home page is generated from README.md: remove it")
    files.append(File.generated(config, "index.md", content=_DOCS_LINK.sub("](", README.read_text())))
    return files
