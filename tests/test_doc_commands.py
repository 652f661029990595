"""Every script command the docs and the README quote parses with the script as it is now.

A documented number names the command that re-creates it; a renamed or removed flag would leave
that command failing for the reader, so each one is parsed here by its script's own
``build_parser()`` (nothing runs: the runs themselves are minutes to hours; each script's
``--smoke`` run is in tests/test_scripts.py).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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


PARSE = """
import importlib.util, json, shlex, sys
sys.path.insert(0, sys.argv[1])  # examples/ import each other as a package
parsers, failures = {}, []
for doc, script, arguments in json.loads(sys.argv[2]):
    if script not in parsers:
        spec = importlib.util.spec_from_file_location("doc_script", f"{sys.argv[1]}/{script}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        parsers[script] = module.build_parser()
    try:
        parsers[script].parse_args(shlex.split(arguments))
    except SystemExit as exit_:
        failures.append(f"{doc}: python {script} {arguments} (exit {exit_.code})")
print(json.dumps(failures))
"""
"""Parses every command in one separate process: importing a script may set what only that
script wants (e.g. bench_kernels sets TRITON_INTERPRET before triton is imported)."""


def test_the_docs_quote_commands_of_every_kind():
    scripts = {script for _, script, _ in documented_commands()}
    assert {"benchmarks/breakeven_validation.py", "examples/experiment.py", "benchmarks/bench_ops.py"} <= scripts


def test_every_documented_command_parses():
    commands = documented_commands()
    for doc, script, _ in commands:
        assert (ROOT / script).is_file(), f"{doc} quotes {script}, which is gone"
    done = subprocess.run([sys.executable, "-c", PARSE, str(ROOT), json.dumps(commands)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "documented commands that no longer parse:\n" + "\n".join(failures)
