"""The documentation site (mkdocs.yml): it builds strictly (a broken link, a page left out of the
nav, a docstring whose parameters do not match its signature all fail), and the links that must
work off the checkout (the README on a package index, the package's Project-URLs) name pages and
files that exist."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from graft_rl.errors import DOCS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from docs_rst import rst_to_markdown  # noqa: E402


def _mkdocs_yml() -> dict:
    class Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python tags; only the plain keys matter here
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocstrings", reason="the docs extra (pip install -e '.[docs]') builds the site")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "reference" / "algo" / "index.html").read_text()
    assert 'id="graft_rl.algo.core.grpo_advantages"' in api  # the API reference is rendered from docstrings
    assert ":func:" not in api and ".. math::" not in api  # reST roles and math are converted


def test_home_is_one_place():
    """pyproject's Project-URLs and mkdocs.yml's site_url / repo_url name the same home."""
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    site = _mkdocs_yml()
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(urls)
    assert urls["Documentation"] == site["site_url"] and urls["Homepage"] == site["repo_url"]
    assert urls["Changelog"] == site["repo_url"] + "/blob/main/CHANGELOG.md"
    assert urls["Documentation"] == DOCS  # what messages and the starter config point a user at


def test_readme_links_work_on_a_package_index():
    """No relative link or image in the README (a package index shows it without the checkout); every
    absolute link into the project names a documentation page or a file that exists."""
    site = _mkdocs_yml()
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    relative = [t for t in targets if not re.match(r"https?://", t)]
    assert not relative, f"relative links break on a package index: {relative}"
    raw = site["repo_url"].replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    for t in targets:
        if t.startswith(site["site_url"]):
            page = t[len(site["site_url"]) :].strip("/")
            assert (ROOT / "docs" / f"{page or 'index'}.md").exists(), t
        elif t.startswith(raw):
            assert (ROOT / t[len(raw) :]).exists(), t
        elif t.startswith(site["repo_url"] + "/blob/main/") or t.startswith(site["repo_url"] + "/tree/main/"):
            assert (ROOT / t.split("/main/", 1)[1]).exists(), t


def test_every_doc_page_is_in_the_nav():
    def pages(nav):
        for item in nav:
            for v in item.values() if isinstance(item, dict) else [item]:
                yield from pages(v) if isinstance(v, list) else [v]

    listed = set(pages(_mkdocs_yml()["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == listed


def test_rst_becomes_markdown():
    text = "See :func:`~graft_rl.algo.policy_loss` and :mod:`graft_rl.methods`; :math:`w = 1`.\n\n    .. math:: a\n        + b\n\nend"
    assert rst_to_markdown(text) == (
        "See `policy_loss` and `graft_rl.methods`; \\(w = 1\\).\n\n    $$\n    a\n    + b\n    $$\n\nend"
    )
