#!/usr/bin/env python3
"""Library files longer than a limit (default 700 lines) before their tests, run from the
repository root: `python3 scripts/long_files.py [LIMIT]`. A file's test code is an inline
`#[cfg(test)] mod name { ... }` and what follows it; a `#[cfg(test)] mod tests;` line (tests in
their own file) does not end the count. Test files (tests/, */tests/, *tests.rs) are skipped.
Prints `lines path` for each file over the limit; exits 1 if any."""
import re
import subprocess
import sys

limit = int(sys.argv[1]) if len(sys.argv) > 1 else 700
files = subprocess.run(["git", "ls-files", "*.rs"], capture_output=True, text=True).stdout.split()
over = []
for f in files:
    if f.startswith("tests/") or "/tests/" in f or f.endswith("tests.rs"):
        continue
    lines = open(f, encoding="utf-8").read().split("\n")
    library = 0
    for i, line in enumerate(lines):
        inline_tests = re.match(r"\s*(pub(\([\w:]+\))? )?mod \w+ \{", lines[i + 1]) if i + 1 < len(lines) else None
        if line.strip() == "#[cfg(test)]" and inline_tests:
            break
        library += 1
    if library > limit:
        over.append((library, f))
for n, f in sorted(over, reverse=True):
    print(n, f)
sys.exit(1 if over else 0)
