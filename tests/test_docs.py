"""The docs check themselves: every relative link in the README and docs/ resolves to a file of the repository,
every command block parses, the site builds with no warning (make docs), and the README stays a front page (the
reference lives in docs/)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def code_blocks(language: str) -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), block) for page in PAGES
            for block in re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), re.S | re.M)]


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target in relative_links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def test_every_command_block_parses():
    """A ```sh block is a command a reader pastes, a ```python block a program: each at least parses."""
    bad = [f"{page}: {block[:60]!r}" for page, block in code_blocks("sh")
           if subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True).returncode != 0]
    for page, block in code_blocks("python"):
        try:
            compile(block, page, "exec")
        except SyntaxError as e:
            bad.append(f"{page}: {e}")
    assert not bad, bad


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_every_docs_page_is_in_the_readmes_index_and_the_sites_nav():
    readme, nav = (ROOT / "README.md").read_text(), (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme or
               f" {p.name}\n" not in nav]
    assert not missing, missing


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (pip install -e '.[test]')")
def test_the_site_builds_without_a_warning(tmp_path):
    """make docs: MkDocs with Material, strict (a warning fails the build)."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
