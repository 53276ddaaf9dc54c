"""Every relative link of the README and of docs/ leads somewhere: to a file of the
repository, and where it names an anchor, to a heading of that file (GitHub's and mkdocs'
slugs: lower case, punctuation dropped, spaces as hyphens)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+://|mailto:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_the_readme_is_a_front_page():
    """What it is, install, the commands, one runnable example, the headline figures and
    the way into docs/, in at most about 12 KB; the details live in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_500
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == ["Install", "The commands", "A first example", "Headline figures",
                        "Documentation"]
    linked = {target.partition("#")[0] for target in links(ROOT / "README.md")}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")
            if p.name not in ("index.md", "api.md")} <= linked


def test_the_api_reference_renders_every_public_name_with_a_docstring():
    import inspect

    import wedlm_kernels as wk

    api = (ROOT / "docs" / "api.md").read_text()
    rendered = set(re.findall(r"^::: wedlm_kernels\.(\w+)$", api, re.M))
    public = {name for name in wk.__all__ if name not in ("BACKEND", "DEBUG")}
    assert rendered == public
    assert all(inspect.getdoc(getattr(wk, name)) for name in public)
