"""The figures the front page and docs/ quote agree with the code, and docs/README.md indexes
every page of docs/.

Cell counts are quoted two ways: a plan's summary line after the command that prints it
(`$ losscheck certify ARGS --list | grep '^plan:'` then the line), regenerated here from the same
planning function `--list` calls; and fixed phrases (`PHRASES`), each computed from the plan.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from losscheck.cli import parser
from losscheck.plan.entry import MatrixEntry
from losscheck.report.plan import plan_lines, planned
from losscheck.run.options import Options, from_parsed
from losscheck.run.session import Session

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LIST_QUOTE = re.compile(r"^\$ losscheck (certify\b.*--list.*?)\s*\|\s*grep '\^plan:'$")


def certify_options(args: str) -> Options:
    """The options `losscheck ARGS` parses to, as `losscheck certify` builds them."""
    ns = parser().parse_args(shlex.split(args))
    return from_parsed(lambda d: getattr(ns, d))


@cache
def plan_line(args: str) -> str:
    """The `plan: N cells (...)` line `losscheck ARGS` prints."""
    return next(line for line in plan_lines(certify_options(args), full=False) if line.startswith("plan:"))


@cache
def entries(args: str) -> tuple[MatrixEntry, ...]:
    return tuple(planned(Session(certify_options(args), skeleton=True))[0])


def count(args: str, mode: str | None = None, quick: bool | None = None) -> int:
    return sum(1 for e in entries(args) if (mode is None or e.mode == mode) and (quick is None or e.slow != quick))


def statistical(args: str, quick: bool | None = None) -> int:
    return count(args, quick=quick) - count(args, "greedy", quick)


MAIN, ALL = "certify --list", "certify --bundled all --list"

# page -> (phrase with one (\d+) per figure, the figures from the plan)
PHRASES: list[tuple[str, str, Callable[[], tuple[int, ...]]]] = [
    ("README.md", r"the (\d+) cells of the bundled reference set", lambda: (count(MAIN),)),
    (
        "docs/matrix-and-tiers.md",
        r"with `--bundled all` the matrix has \*\*(\d+) cells\*\*, of which (\d+) are statistical",
        lambda: (count(ALL), statistical(ALL)),
    ),
    (
        "docs/matrix-and-tiers.md",
        r"the main job plans \*\*(\d+) cells\*\*, (\d+) of them statistical",
        lambda: (count(MAIN), statistical(MAIN)),
    ),
    (
        "docs/matrix-and-tiers.md",
        r"the quick gate has (\d+)\s+cells \((\d+) greedy, (\d+) PIT, (\d+) exact; (\d+) statistical\) and the "
        r"slow tier (\d+); of the main job's (\d+),\s+(\d+) are in the quick gate",
        lambda: (
            count(ALL, quick=True),
            count(ALL, "greedy", True),
            count(ALL, "pit", True),
            count(ALL, "exact", True),
            statistical(ALL, quick=True),
            count(ALL, quick=False),
            count(MAIN),
            count(MAIN, quick=True),
        ),
    ),
]


def list_quotes() -> list[tuple[str, str, str]]:
    """(page, the `losscheck` arguments, the plan line quoted after them) for every quote."""
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for line, following in zip(lines, lines[1:]):
            match = LIST_QUOTE.match(line.strip())
            if match:
                found.append((page.relative_to(ROOT).as_posix(), match.group(1), following.strip()))
    return found


def test_the_docs_quote_plans():
    # the quotes the pages are known to hold; a page that drops them should say so here
    assert {(page, args) for page, args, _ in list_quotes()} >= {
        ("docs/matrix-and-tiers.md", MAIN),
        ("docs/matrix-and-tiers.md", ALL),
    }


@pytest.mark.parametrize(("page", "args", "quoted"), list_quotes())
def test_a_quoted_plan_is_the_plan(page, args, quoted):
    assert quoted == plan_line(args), (
        f"{page} quotes `losscheck {args}` as {quoted!r}; the plan says {plan_line(args)!r}"
    )


@pytest.mark.parametrize(
    ("page", "phrase", "figures"), PHRASES, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(PHRASES)]
)
def test_a_quoted_cell_count_is_the_plans(page, phrase, figures):
    text = (ROOT / page).read_text(encoding="utf-8")
    match = re.search(phrase, text)
    assert match, f"{page} no longer says /{phrase}/: update the page or this test's PHRASES"
    quoted = tuple(int(n) for n in match.groups())
    assert quoted == figures(), f"{page}: /{phrase}/ quotes {quoted}; the plan gives {figures()}"


def test_the_documentation_index_links_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", index))
    pages = {page.name for page in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
