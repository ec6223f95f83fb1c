"""docs/options.md, rendered from the option specs (`losscheck.run.options.SPECS`).

The page is generated, never edited by hand: after changing an option run
`python -m losscheck.report.options_doc`; a test fails while the page and `render()` differ.
Imports nothing heavy (the specs module loads no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from losscheck.run.options import SPECS, OptionSpec

COMMAND = "python -m losscheck.report.options_doc"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"

INTRO = f"""\
# Options

<!-- Generated from losscheck/run/options.py by `{COMMAND}`; do not edit. -->

Every option exists twice, declared once: as a pytest option with the `--losscheck-` prefix
(`pytest --pyargs losscheck.plugin.certify -m lossless --losscheck-seed=7`) and as an option of
`losscheck certify` without it (`losscheck certify --seed 7`). `losscheck certify` takes all of
them, plus `-n/--workers` (pytest-xdist workers: one per core on the CPU, in process on a GPU) and
writes under `reports/` when `--out` is not given; `losscheck perf`, `mutants`, `families` and
`bench` take the subsets their `--help` lists.

Options are checked before anything loads (model directories, import paths, the prompt file,
the output directory): a bad one is one `ERROR:` line and exit status 4 under pytest, one
`losscheck certify: error:` line and exit status 2 under `losscheck`. `LOSSCHECK_FIXTURES=DIR`
points at another copy of the bundled fixtures.
"""


def _text(value: Any) -> str:
    """A default as it is typed on the command line (parsed precisions back to `fp32,bf16/...`)."""
    if isinstance(value, tuple):
        return ",".join(v.label() if hasattr(v, "label") else str(v) for v in value)
    return str(value)


def _cell(text: str) -> str:
    """`text` safe inside a Markdown table cell: no column breaks, no HTML tags."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _value(spec: OptionSpec) -> str:
    """What follows the option's name: `=METAVAR`, `=a|b` for choices, nothing for a flag."""
    if spec.get("action") == "store_true":
        return ""
    if "choices" in spec:
        return "=" + "|".join(str(c) for c in spec["choices"])
    return "=" + spec.get("metavar", "VALUE")


def _default(spec: OptionSpec) -> str:
    if spec.get("action") == "store_true":
        return "off"
    default = spec.get("default")
    return "–" if default is None else f"`{_text(default)}`"


def _help(spec: OptionSpec) -> str:
    """The help text as argparse prints it (`%(default)s` filled in, `%%` as `%`)."""
    return spec["help"] % {**spec, "default": _text(spec.get("default"))}


def render() -> str:
    """The Markdown of docs/options.md: one row per option of `SPECS`, in declaration order."""
    rows = ["| pytest | `losscheck certify` | default | meaning |", "|---|---|---|---|"]
    for name, spec in SPECS.items():
        value = _value(spec)
        cli = f"--{name} {value[1:]}" if value else f"--{name}"
        rows.append(
            f"| `{_cell('--losscheck-' + name + value)}` | `{_cell(cli)}` | {_cell(_default(spec))} "
            f"| {_cell(_help(spec))} |"
        )
    return INTRO + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE}")
