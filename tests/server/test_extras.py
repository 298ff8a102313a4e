"""The server and the engine run without the ``tools`` extra (rich, matplotlib, httpx); a tool
command without it says which extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: Run first in each subprocess: makes the tools-only packages impossible to import.
_HIDE_TOOLS = """
import importlib.abc, sys
class HideTools(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"rich", "matplotlib", "httpx"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])
        return None
sys.meta_path.insert(0, HideTools())
"""


def run_without_tools(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _HIDE_TOOLS + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_server_and_the_engine_import_without_the_tools_extra() -> None:
    result = run_without_tools("""
        import prefixserve.server.app, prefixserve.server.launch, prefixserve.engine.async_llm
        from prefixserve.cli import build_parser
        build_parser().parse_args(["serve", "--help"])
    """)
    assert "usage: prefixserve serve" in result.stdout, result.stderr
    assert "ModuleNotFoundError" not in result.stderr


def test_a_tool_without_the_extra_names_the_extra() -> None:
    result = run_without_tools("""
        import sys
        from prefixserve.cli import main
        sys.exit(main(["bench", "compare", "a.json"]))
    """)
    assert result.returncode == 2, result.stderr
    assert "pip install 'prefixserve[tools]'" in result.stderr
    assert "Traceback" not in result.stderr
