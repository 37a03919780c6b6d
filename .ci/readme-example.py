#!/usr/bin/env python3
"""Fails when a README's quick start is not, character for character, the
example file it names: the example is what CI builds and runs (its test
runs it against the real broker and PostgreSQL), so the README shows code
that compiles and works.

A quick start is marked in the README as

    <!-- quick-start: path/to/example.rs -->
    ```rust
    ...the file's text...
    ```
    <!-- /quick-start -->

Usage: python3 .ci/readme-example.py [README.md ...]
       python3 .ci/readme-example.py --fill README.md   (rewrites the blocks)
"""

import re
import sys
from pathlib import Path

BLOCK = re.compile(
    r"<!-- quick-start: (?P<path>\S+) -->\n```(?P<lang>[^\n]*)\n(?P<code>.*?)```\n<!-- /quick-start -->",
    re.S,
)


def check(readme: Path, fill: bool) -> list[str]:
    text = readme.read_text()
    problems = []
    blocks = list(BLOCK.finditer(text))
    if not blocks:
        problems.append(f"{readme}: no <!-- quick-start: ... --> block")

    def replace(match: re.Match) -> str:
        path = readme.parent / match["path"]
        if not path.is_file():
            problems.append(f"{readme}: {match['path']} does not exist")
            return match[0]
        code = path.read_text()
        if fill:
            return f"<!-- quick-start: {match['path']} -->\n```rust\n{code}```\n<!-- /quick-start -->"
        if match["code"] != code:
            problems.append(
                f"{readme}: the quick start differs from {match['path']} "
                f"(run: python3 .ci/readme-example.py --fill {readme})"
            )
        return match[0]

    new = BLOCK.sub(replace, text)
    if fill and new != text:
        readme.write_text(new)
    return problems


def main() -> int:
    args = sys.argv[1:]
    fill = "--fill" in args
    readmes = [Path(a) for a in args if a != "--fill"] or [Path("README.md")]
    problems = [p for r in readmes for p in check(r, fill)]
    for problem in problems:
        print(f"readme-example: {problem}", file=sys.stderr)
    if not problems:
        print(f"readme-example: {len(readmes)} README(s) match their examples")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
