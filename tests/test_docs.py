"""The user pages (README, the user guide, the API page, the notebooks' text) speak to users:
no commit hashes, no private modules or functions of the package, no link to another
project's pages. Design notes and their measurements live on the contributor pages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
USER_PAGES = [ROOT / "README.md"] + [
    ROOT / "docs" / f"{name}.md"
    for name in (
        "index",
        "getting-started",
        "accessor",
        "engine",
        "writing",
        "remote",
        "performance",
        "troubleshooting",
        "api",
    )
]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))

#: a commit hash: 7 to 40 hex digits with a letter and a digit among them
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
#: the package's private modules and names a user never calls
PRIVATE = re.compile(
    r"cupy_xarray[./](xarray[./])?(engine|cf|device|loader|chunked|containment"
    r"|backend(?!\.KvikioBackendEntrypoint))\b"
    r"|\bengine/\w+\.py|\bdecoders\.registry\b|\b(read_arrays|StreamDecoder|Boxes|find_backend_array"
    r"|resolve_device|array_spec|_in_memory)\b"
)
#: words of how the project is made, not of what it does
PROCESS = re.compile(r"\bA/B\b|\bstart of the machine\b|\bissue #?\d+", re.IGNORECASE)
LINK = re.compile(r"\]\((https?://[^)]+)\)|<(https?://[^>]+)>")


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


PAGES = USER_PAGES + NOTEBOOKS


#: contributor pages: they narrate runs, but name no commit in prose either (the generated
#: tables carry their provenance in one line each)
CONTRIBUTOR_PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "contributing.md"]


@pytest.mark.parametrize("path", PAGES + CONTRIBUTOR_PAGES, ids=lambda p: p.name)
def test_user_pages_name_no_commit(path):
    found = COMMIT.findall(_text(path))
    assert not found, f"{path.name}: commit hashes {found}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_user_pages_name_no_private_module_or_function(path):
    found = [m.group(0) for m in PRIVATE.finditer(_text(path))]
    assert not found, f"{path.name}: private names {found} (design notes go to docs/contributing.md)"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_user_pages_speak_of_the_package_not_of_its_making(path):
    found = [m.group(0) for m in PROCESS.finditer(_text(path))]
    assert not found, f"{path.name}: {found}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_user_pages_link_to_no_web_page(path):
    """The project has no public address: a link could only point at another project's pages."""
    found = [a or b for a, b in LINK.findall(_text(path))]
    assert not found, f"{path.name}: links {found}"


def test_the_patterns_catch_what_they_are_for():
    assert COMMIT.search("measured at 1274e57 on an H200")
    assert not COMMIT.search("4 GiB of float32 in 1024 tiles, deadline")
    assert PRIVATE.search("see `engine/route.py`") and PRIVATE.search("cupy_xarray.engine.read_arrays")
    assert not PRIVATE.search(
        "cupy_xarray.xarray.backend.KvikioBackendEntrypoint and cupy_xarray.errors.ChunkError"
    )
    assert PROCESS.search("an A/B run") and LINK.search("[docs](https://example.org/x)")


def _prose_units(text: str) -> list[str]:
    """A page's paragraphs and list items, code blocks, tables, headings and labels left out."""
    units, fence, cur = [], False, []
    for line in text.splitlines():
        st = line.strip()
        if st.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if not st or st.startswith(("|", "<!--", "#", "{", ":")) or re.fullmatch(r"\(.*\)=", st):
            if cur:
                units.append(" ".join(cur))
                cur = []
            continue
        if re.match(r"([-*]|\d+\.)\s", st) and cur:
            units.append(" ".join(cur))
            cur = []
        cur.append(st)
    if cur:
        units.append(" ".join(cur))
    return units


def sentence_lengths(text: str) -> list[int]:
    """Words per sentence of a page's prose (inline code counts as one word)."""
    lengths = []
    for unit in _prose_units(text):
        unit = re.sub(r"`[^`]*`", "X", unit)
        unit = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", unit)
        unit = re.sub(r"^([-*]|\d+\.)\s+", "", unit)
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(`*\[X])", unit):
            if len(sentence.split()) > 2:
                lengths.append(len(sentence.split()))
    return lengths


@pytest.mark.parametrize("page", [p for p in USER_PAGES if p.name != "api.md"], ids=lambda p: p.name)
def test_the_user_pages_speak_in_short_sentences(page):
    lengths = sentence_lengths(page.read_text())
    assert lengths and sum(lengths) / len(lengths) <= 25, (page.name, sum(lengths) / len(lengths))


def test_the_user_pages_do_not_narrate_measurements():
    narration = re.compile(
        r"within\s+an\s+hour|\bcampaign\b|in\s+our\s+tests|\bof\s+\d+\s+small\s+reads\b|best\s+and\s+median",
        re.IGNORECASE,
    )
    for page in USER_PAGES:
        found = narration.findall(page.read_text())
        assert not found, (page.name, found)
