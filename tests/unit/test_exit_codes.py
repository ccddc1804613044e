"""The exit codes are defined once (rlrunner.errors.EXIT_CODES): the launch script, the README and --help agree
with it."""

from __future__ import annotations

import re
from pathlib import Path

from rlrunner.errors import EXIT_CODES, exit_codes_text
from rlrunner.main_grpo import parse_args

REPO = Path(__file__).resolve().parents[2]


def test_the_launch_script_ends_on_exactly_the_codes_the_table_says_it_does_not_relaunch():
    script = (REPO / "launch" / "run_main_grpo.sh").read_text()
    cases = re.findall(r'^\s*(\d+)\) say "([^"]*)"; exit (\d+) ;;$', script, re.M)
    assert all(code == exit_code for code, _, exit_code in cases)
    assert {code: words for code, words, _ in cases} == {e.code: e.script_says for e in EXIT_CODES if e.script_says}
    assert [e.code for e in EXIT_CODES if e.script_says is None] == ["1", "128+N"]  # relaunched, or a second signal


def test_the_readme_table_is_the_table():
    readme = (REPO / "README.md").read_text()
    header = readme.index("| exit code | meaning |")
    rows = []
    for line in readme[header:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        code, meaning = (cell.strip() for cell in line.strip("|").split("|", 1))
        rows.append((code, meaning))
    assert rows == [(e.code, e.meaning) for e in EXIT_CODES]


def test_help_prints_the_table(capsys):
    try:
        parse_args(["--help"])
    except SystemExit as done:
        assert done.code == 0
    out = capsys.readouterr().out
    assert exit_codes_text() in out
    for entry in EXIT_CODES:
        assert re.search(rf"^  {re.escape(entry.code)}\s", out, re.M), entry.code
