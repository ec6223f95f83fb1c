"""docs/options.md is generated from the option specs and kept current."""

from __future__ import annotations

import subprocess
import sys

from losscheck.report.options_doc import COMMAND, PAGE, render
from losscheck.run.options import SPECS


def test_options_page_is_current():
    assert PAGE.read_text(encoding="utf-8") == render(), (
        f"docs/options.md differs from losscheck.run.options.SPECS: run `{COMMAND}` and commit the page"
    )


def test_every_option_is_listed():
    page = render()
    missing = [name for name in SPECS if f"| `--losscheck-{name}" not in page or f"| `--{name}" not in page]
    assert not missing, f"options without a row in docs/options.md: {missing}"


def test_rendering_imports_no_torch():
    code = "import sys, losscheck.report.options_doc as d; d.render(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "rendering the options page imported torch"
