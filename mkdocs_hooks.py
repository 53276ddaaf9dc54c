"""mkdocs hook: links from docs/ to repository files outside it (``../examples/...``) are
not pages of the site. Each must name an existing file (the build fails otherwise); in the
site it is shown as that file's path."""

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_OUTSIDE = re.compile(r"(?<!!)\[([^\]]*)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):
    page_dir = Path(page.file.abs_src_path).parent
    root = Path(config["docs_dir"]).resolve().parent

    def repository_path(match):
        target = (page_dir / match.group(2)).resolve()
        if not target.exists():
            raise PluginError(f"{page.file.src_path}: link to a missing file {match.group(2)}")
        text, path = match.group(1), target.relative_to(root).as_posix()
        return text if text.strip("`") == path else f"{text} (`{path}`)"

    return _OUTSIDE.sub(repository_path, markdown)
