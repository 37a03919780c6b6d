#!/usr/bin/env python3
"""Fails on an import cycle among consumer-app's library modules, or on an
import against its layering (runtime <- parcel <- tools).

A module is a file under consumer-app/src (lib.rs is `crate`, a/mod.rs is
`a`, a/b.rs is `a::b`); binaries (main.rs, src/bin) are not modules of the
library. An edge A -> B is a `crate::`, `super::` or `self::` path in A (a
`use` or a path in code) naming B or an item of B. A `pub use` in a module is
a re-export, not a dependency of that module's code: a path through it is
resolved to the module the item comes from. `#[cfg(test)]` modules are left
out (tests may reach anywhere).

Usage: python3 .ci/module-cycles.py [consumer-app/src]
       python3 .ci/module-cycles.py --self-test   (the check can fail)
"""

import re
import sys
from pathlib import Path

# Which top-level module may import which: the runtime knows no domain and
# no tool, the Parcel domain knows the runtime, the tools know both.
LAYERS = {"runtime": 0, "parcel": 1, "tools": 2}


def module_name(src: Path, file: Path) -> str:
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts == ["lib"]:
        return "crate"
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts)


def strip(text: str) -> str:
    """Drops comments, string and char literals (so that paths in docs or
    log lines are not imports)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\])'", "' '", text)
    return text


def drop_test_modules(text: str) -> str:
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def expand(tree: str) -> list[tuple[list[str], str]]:
    """`a::{b, c::d as e, self}` -> [(['a','b'], 'b'), (['a','c','d'], 'e'), (['a'], 'a')]."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        alias = None
        if " as " in tree:
            tree, alias = (s.strip() for s in tree.split(" as ", 1))
        segs = [s for s in tree.split("::") if s]
        return [(segs, alias or (segs[-1] if segs else ""))]
    prefix = [s for s in tree[:brace].split("::") if s]
    inner = tree[brace + 1 : tree.rfind("}")]
    items, depth, start = [], 0, 0
    for k, ch in enumerate(inner):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(inner[start:k])
            start = k + 1
    items.append(inner[start:])
    result = []
    for item in items:
        if not item.strip():
            continue
        if item.strip() == "self":
            result.append((prefix, prefix[-1]))
            continue
        for segs, alias in expand(item):
            result.append((prefix + segs, alias))
    return result


def absolute(segs: list[str], here: str, modules: set[str]) -> list[str] | None:
    """A path as segments from the crate root, or None for another crate."""
    if not segs:
        return None
    current = [] if here == "crate" else here.split("::")
    if segs[0] == "crate":
        return segs[1:]
    if "::".join(current + segs[:1]) in modules:
        # `use child::Item` (a path relative to this module).
        return current + segs
    if segs[0] in ("super", "self"):
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                current = current[:-1]
            segs = segs[1:]
        return current + segs
    return None


def check(src: Path) -> tuple[str, list[str]]:
    """The summary line and the failures of the tree under `src`."""
    files = {}
    for file in sorted(src.rglob("*.rs")):
        rel = file.relative_to(src)
        if rel.parts[0] == "bin" or rel == Path("main.rs"):
            continue
        files[module_name(src, file)] = drop_test_modules(strip(file.read_text()))
    modules = set(files)

    def deepest(segs: list[str]) -> tuple[str, list[str]]:
        for n in range(len(segs), 0, -1):
            name = "::".join(segs[:n])
            if name in modules:
                return name, segs[n:]
        return "crate", segs

    use_re = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
    uses, exports = {}, {}
    for name, text in files.items():
        uses[name], exports[name] = [], {}
        for m in use_re.finditer(text):
            for segs, alias in expand(m.group(2)):
                path = absolute(segs, name, modules)
                if path is None:
                    continue
                if m.group(1):
                    exports[name][alias] = path
                else:
                    uses[name].append(path)
        # Paths in code: crate::a::b::item(...), super::x, etc.
        code = use_re.sub(" ", text)
        for m in re.finditer(r"\b(?:crate|super|self)(?:::\w+)+", code):
            path = absolute(m.group(0).split("::"), name, modules)
            if path is not None:
                uses[name].append(path)

    def resolve(path: list[str], seen: int = 0) -> str:
        module, rest = deepest(path)
        if rest and rest[0] in exports.get(module, {}) and seen < 16:
            return resolve(exports[module][rest[0]], seen + 1)
        return module

    edges = set()
    for name, paths in uses.items():
        for path in paths:
            target = resolve(path)
            if target != name:
                edges.add((name, target))

    failures = []
    for a, b in sorted(edges):
        la, lb = LAYERS.get(a.split("::")[0]), LAYERS.get(b.split("::")[0])
        if la is not None and lb is not None and lb > la:
            failures.append(f"layering: {a} imports {b}")

    # Tarjan's strongly connected components.
    graph = {m: sorted(b for a, b in edges if a == m) for m in modules}
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in sorted(modules):
        if v not in index:
            visit(v)
    for scc in sccs:
        inner = sorted(f"{a} -> {b}" for a, b in edges if a in scc and b in scc)
        failures.append("cycle among " + ", ".join(scc) + ": " + "; ".join(inner))

    depth = {}

    def floors(v: str, trail: frozenset = frozenset()) -> int:
        if v in depth:
            return depth[v]
        if v in trail:
            return 0
        d = 1 + max((floors(w, trail | {v}) for w in graph[v]), default=0)
        depth[v] = d
        return d

    longest = max((floors(v) for v in modules), default=0)
    summary = (
        f"module-cycles: {len(modules)} modules, {len(edges)} edges, "
        f"{len(sccs)} cycles, {longest} floors of imports"
    )
    return summary, failures


def self_test() -> int:
    """A tree with a cycle through a re-export and a runtime module that
    imports the domain must fail with both; the same tree without them must
    pass."""
    import tempfile

    tree = {
        "lib.rs": "pub mod parcel;\npub mod runtime;\n",
        "runtime/mod.rs": "pub mod a;\npub mod b;\npub use a::A;\n",
        "runtime/a.rs": "use crate::runtime::b::B;\npub struct A(B);\n",
        "runtime/b.rs": "pub struct B;\nfn f() -> super::A { todo!() }\n",
        "parcel/mod.rs": "use crate::runtime::A;\npub struct P;\n",
        "runtime/c.rs": "// crate::parcel::P in a comment is no import\nuse crate::parcel::P;\n",
    }
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        for name, text in tree.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(text)
        (src / "runtime/mod.rs").write_text("pub mod a;\npub mod b;\npub mod c;\npub use a::A;\n")
        _, failures = check(src)
        cycle = [f for f in failures if f.startswith("cycle among runtime::a, runtime::b")]
        layering = [f for f in failures if f == "layering: runtime::c imports parcel"]
        if len(failures) != 2 or not cycle or not layering:
            print(f"module-cycles self-test: expected a cycle and a layering failure, got {failures}")
            return 1
        (src / "runtime/b.rs").write_text("pub struct B;\n")
        (src / "runtime/c.rs").write_text("use crate::runtime::A;\n")
        summary, failures = check(src)
        if failures:
            print(f"module-cycles self-test: a clean tree failed: {failures}")
            return 1
    print("module-cycles self-test: a cycle and a layering breach caught, a clean tree passes")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "consumer-app/src")
    summary, failures = check(src)
    print(summary)
    for failure in failures:
        print(f"  {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
