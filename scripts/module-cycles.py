#!/usr/bin/env python3
"""Checks that the modules of a crate import each other without a cycle.

Usage: scripts/module-cycles.py crates/chunnel-negotiate/src

Each file under the source directory is a module (`a/b.rs` and `a/b/mod.rs` are `a::b`; the
crate root `lib.rs` is left out, as it only declares and re-exports). An edge `m -> n` is any
`crate::n...` path in a non-comment line of `m`'s file (in `use` items or inline paths),
resolved to the longest module path that exists; a name the crate root re-exports
(`crate::Error`) counts as its defining module's. A file's `#[cfg(test)] mod tests` block
counts too. Prints the edges and exits 1 with the cycle if there is one.
"""

import pathlib
import re
import sys


def module_of(root: pathlib.Path, f: pathlib.Path) -> str:
    rel = f.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "mod":
        parts.pop()
    return "::".join(parts)


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "src")
    files = {module_of(root, f): f for f in root.rglob("*.rs") if f.name != "lib.rs"}
    mods = set(files)
    # Names the crate root re-exports (`pub use crate::m::{A, B}`): `crate::A` is `m`'s.
    reexports: dict[str, str] = {}
    lib = root / "lib.rs"
    if lib.exists():
        text = lib.read_text()
        for m, names in re.findall(r"pub use crate::([a-z_:]+)::\{([^}]*)\}", text):
            for n in names.split(","):
                if n.strip():
                    reexports[n.strip()] = m
        for m, n in re.findall(r"pub use crate::([a-z_:]+)::([A-Za-z_]+);", text):
            reexports[n] = m
    edges: dict[str, set[str]] = {m: set() for m in mods}
    path_re = re.compile(r"crate::((?:[a-z_][a-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)")
    group_re = re.compile(r"use crate::\{([^}]*)\}")
    for m, f in files.items():
        for line in f.read_text().splitlines():
            code = line.split("//", 1)[0]
            targets = path_re.findall(code)
            for g in group_re.findall(code):
                targets += [t.strip().split("::")[0] for t in g.split(",") if t.strip()]
            for t in targets:
                parts = t.split("::")
                if parts[0] in reexports:
                    parts = reexports[parts[0]].split("::") + parts
                for k in range(len(parts), 0, -1):
                    cand = "::".join(parts[:k])
                    if cand in mods:
                        # A submodule depending on its parent (or a parent on a child) is
                        # structure, not an import cycle: only edges between siblings count.
                        if cand != m and not cand.startswith(m + "::") and not m.startswith(cand + "::"):
                            edges[m].add(cand)
                        break
    for m in sorted(edges):
        print(f"{m} -> {', '.join(sorted(edges[m])) or '(nothing)'}")
    fine = {m: set(ns) for m, ns in edges.items()}
    # Depth-first search for a back edge.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                c = visit(n)
                if c:
                    return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(mods):
        if m not in state:
            c = visit(m)
            if c:
                print("cycle: " + " -> ".join(c))
                return 1
    # A child module may use its parent's items (`use super::...`), and an edge into a child is
    # an edge into its parent's subtree: check the graph of top-level modules too.
    top = lambda m: m.split("::")[0]
    edges = {t: set() for t in {top(m) for m in mods}}
    for m, ns in fine.items():
        for n in ns:
            if top(n) != top(m):
                edges[top(m)].add(top(n))
    mods = set(edges)
    state.clear()
    stack.clear()
    for m in sorted(mods):
        if m not in state:
            c = visit(m)
            if c:
                print("cycle between top-level modules: " + " -> ".join(c))
                return 1
    print("no import cycle (between modules, nor between top-level modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
