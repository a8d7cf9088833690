"""The docs check themselves: every relative link in the README and docs/ resolves to a file of the repository,
and the README stays a front page (the reference lives in docs/)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target in relative_links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_docs_page_is_in_the_readmes_index():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not missing, missing
