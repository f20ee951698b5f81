"""MkDocs hooks (mkdocs.yml): repository files that a page links to are published with the site.

A page in docs/ links to a file elsewhere in the repository the way GitHub reads it, relative to the page
(``../benchmarks/results/study/study.png``, ``../recipes/qwen7b.yaml``). MkDocs only knows the files under docs/, so
each such target that exists is added to the site under ``_repo/`` and the link rewritten to it. A target that does
not exist is left as written, and the strict build reports it as a broken link.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

PREFIX = "_repo"
# a Markdown link or image target that leaves docs/: ](../path) or ](../path#anchor)
LINK = re.compile(r"\]\(\.\./([^)#\s]+)((?:#[^)\s]*)?)\)")


def _targets(page_path: Path, docs: Path) -> dict[str, Path]:
    """The ``../`` targets of one page that exist in the repository and lie outside docs/."""
    root = docs.parent
    found = {}
    for match in LINK.finditer(page_path.read_text(encoding="utf-8")):
        target = (page_path.parent / ".." / match.group(1)).resolve()
        if target.is_file() and root in target.parents and docs not in target.parents:
            found[match.group(1)] = target
    return found


def on_files(files, *, config):
    docs = Path(config["docs_dir"]).resolve()
    for page in list(files.documentation_pages()):
        for relative, target in _targets(Path(page.abs_src_path), docs).items():
            uri = f"{PREFIX}/{relative}"
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(target)))
    return files


def on_page_markdown(markdown, *, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    if Path(page.file.abs_src_path).parent != docs:  # pages sit at the top of docs/; ../ means the repository
        return markdown
    existing = _targets(Path(page.file.abs_src_path), docs)

    def rewrite(match: re.Match) -> str:
        if match.group(1) not in existing:
            return match.group(0)
        return f"]({PREFIX}/{match.group(1)}{match.group(2)})"

    return LINK.sub(rewrite, markdown)
