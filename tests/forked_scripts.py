"""Runs bench scripts as ``python bench/SCRIPT ARGS...`` would, each in a fork of this one process, which
first imports what the scripts import: a table of quick refusals then takes a minute instead of an
interpreter start and the imports of torch and coreply (3-6 s here) a case.

stdin: JSON ``[[script, [arg, ...]], ...]``; stdout: JSON ``[[exit code, stderr], ...]`` in that order. A
case still running after ``TIMEOUT_S`` is killed (exit code -14, SIGALRM).
"""

import ast
import contextlib
import importlib
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
TIMEOUT_S = 120


def preload(scripts: set[str]) -> None:
    """Import once, before any fork, every module the scripts import at their top level (coreply's and
    torch's take seconds); one that fails is left for the case to fail on."""
    sys.path.insert(0, str(BENCH))
    for script in scripts:
        for node in ast.parse((BENCH / script).read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
    sys.path.remove(str(BENCH))


def child(script: str, args: list[str]) -> int:
    """The script as ``__main__``, its folder first on sys.path as Python puts it; the exit code Python
    would give (a SystemExit's message goes to stderr with 1)."""
    sys.argv = [str(BENCH / script), *args]
    sys.path.insert(0, str(BENCH))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def run(script: str, args: list[str]) -> tuple[int, str]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the case: stderr into the pipe, stdout discarded
        os.close(read)
        os.dup2(write, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        signal.alarm(TIMEOUT_S)
        code = child(script, args)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        err = pipe.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    preload({script for script, _ in cases})
    json.dump([run(script, args) for script, args in cases], sys.stdout)
