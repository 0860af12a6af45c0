"""The README and docs/: links that resolve, a README that reads in a minute, and README figures that name the
committed result they come from."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")
PAGES = [os.path.join(REPO, "README.md")] + sorted(
    os.path.join(DOCS, name) for name in os.listdir(DOCS) if name.endswith(".md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:x|%| ?(?:us|ms|s))(?![\w-])")


def _prose(path: str) -> str:
    """The page without its fenced code blocks (commands there are not links or figures)."""
    with open(path) as f:
        return re.sub(r"```.*?```", "", f.read(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_relative_links_resolve(page):
    missing = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor in the same page
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#", 1)[0]))
        if not os.path.exists(path):
            missing.append(target)
    assert not missing, f"{os.path.relpath(page, REPO)} links to files that do not exist: {missing}"


def test_readme_reads_in_a_minute():
    words = len(_prose(os.path.join(REPO, "README.md")).split())
    assert words <= 900, f"README.md has {words} words outside code blocks (at most 900: move detail to docs/)"


def test_every_readme_figure_names_its_result_file():
    """A line (a table row or a sentence's line) with a measured figure names a file under benchmarks/results/."""
    bare = []
    for line in _prose(os.path.join(REPO, "README.md")).splitlines():
        if FIGURE.search(line) and "benchmarks/results/" not in line and "minutes" not in line:
            bare.append(line.strip())
    assert not bare, "README lines with figures but no result file:\n" + "\n".join(bare)
