"""The README's two commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- commands -->\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md must hold the commands block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "bash launch.sh" in cmds[0]
    assert "pytest" in cmds[1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmds[1] in ci  # verbatim
