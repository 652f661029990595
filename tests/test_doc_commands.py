"""Every script command the docs and the README quote parses with the script as it is now.

A documented number names the command that re-creates it; a renamed or removed flag would leave
that command failing for the reader, so each one is parsed here by its script's own
``build_parser()`` (nothing runs: the runs themselves are minutes to hours; each script's
``--smoke`` run is in tests/test_scripts.py).
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python ((?:benchmarks|examples)/\w+\.py)([^`|#\n]*)")
SHELL_VALUES = {"$hook": "int8"}
"""Shell variables the docs' loops use, and a value each takes there."""


def documented_commands() -> list[tuple[str, str, str]]:
    """(doc, script, arguments) of every command quoted in the docs; continuation lines and
    inline code wrapped in the prose joined; commands with an ellipsis (an abbreviation, not a
    command) left out."""
    found = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        # an inline `code span` wrapped over two lines of prose is one command
        text = re.sub(r"(?<!`)`(?!`)[^`\n]+\n[^`\n]+`(?!`)", lambda m: m.group(0).replace("\n", " "), text)
        for script, arguments in COMMAND.findall(text):
            if "..." in arguments:
                continue
            for variable, value in SHELL_VALUES.items():
                arguments = arguments.replace(variable, value)
            found.append((doc.name, script, arguments.strip()))
    return sorted(set(found))


@cache
def parser_of(script: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # examples/ import each other as a package
    spec = importlib.util.spec_from_file_location(f"doc_script_{Path(script).stem}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module.build_parser()


def test_the_docs_quote_commands_of_every_kind():
    scripts = {script for _, script, _ in documented_commands()}
    assert {"benchmarks/breakeven_validation.py", "examples/experiment.py", "benchmarks/bench_ops.py"} <= scripts


@pytest.mark.parametrize("doc, script, arguments", documented_commands())
def test_documented_command_parses(doc, script, arguments):
    assert (ROOT / script).is_file(), f"{doc} quotes {script}, which is gone"
    try:
        parser_of(script).parse_args(shlex.split(arguments))
    except SystemExit as exit_:
        pytest.fail(f"{doc}: `python {script} {arguments}` no longer parses (exit {exit_.code})")
