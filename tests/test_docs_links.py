"""The README's and docs/' relative links point at files that exist, and the method they cite is in the
repository (docs/METHOD.md), not in a file outside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh"}  # code, docs, configs and scripts (not recorded result data)


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    """The link targets in a markdown file that name a file of the repository (no URL, no bare anchor)."""
    targets = LINK.findall(path.read_text())
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_link_parser_sees_relative_links_only():
    sample = ROOT / "tests" / "_links_sample.md"
    try:
        sample.write_text("[a](docs/METHOD.md) [b](https://x.org/y) [c](#anchor) [d](../up.md#part) `[e](f)`\n")
        assert relative_links(sample) == ["docs/METHOD.md", "../up.md#part", "f"]
    finally:
        sample.unlink()


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for md in _markdown_files():
        for target in relative_links(md):
            if not (md.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert "docs/METHOD.md" in relative_links(ROOT / "README.md")


def test_the_method_is_cited_from_inside_the_repository():
    """Docstrings, docs and scripts cite docs/METHOD.md; nothing points at a PAPER.md the repository lacks."""
    offenders = []
    for path in ROOT.rglob("*"):
        if ".git" in path.parts or not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        if path == Path(__file__):
            continue
        if "PAPER" + ".md" in path.read_text(errors="replace"):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
    method = (ROOT / "docs" / "METHOD.md").read_text()
    for heading in ("## Symbols", "## The decision rule", "## The cost model", "## Eq. 5", "## B_KV",
                    "## Algorithm 1", "## Table 1"):
        assert heading in method, heading


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_results_is_a_reference_under_600_lines_and_every_cited_section_exists():
    results = (ROOT / "docs" / "RESULTS.md").read_text()
    assert len(results.splitlines()) < 600
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", results, re.MULTILINE)}
    cited = [a for f in _markdown_files() for a in re.findall(r"RESULTS\.md#([\w\-]+)", f.read_text())]
    cited += re.findall(r"\]\(#([\w\-]+)\)", results)
    assert cited and sorted(set(cited) - anchors) == []
    assert _anchor("Knee prediction with measured step costs") == "knee-prediction-with-measured-step-costs"
