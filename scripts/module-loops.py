#!/usr/bin/env python3
"""Lists import cycles between the modules of a crate's library (none in any crate: gateway/tests/module_graph.rs).

Usage: scripts/module-loops.py gateway/src

A module is a file under SRC (`a/b.rs` and `a/b/mod.rs` are `a::b`); an edge is a `use` or a
path naming `crate::x::...` or `super::x` from another module. A parent's `mod` declarations
and re-exports (`pub use`) are not edges: re-exports name the API, not a dependency of the
parent's own code. Prints each cycle found and exits 1, or says none and exits 0.
"""
import re, sys
from pathlib import Path

src = Path(sys.argv[1] if len(sys.argv) > 1 else "gateway/src")
mods = {}
for f in src.rglob("*.rs"):
    rel = f.relative_to(src)
    if rel.parts[0] == "bin":
        continue
    parts = list(rel.with_suffix("").parts)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    mods["::".join(parts)] = f.read_text()

def resolve(here, path):
    segs = path.split("::")
    if segs[0] == "crate":
        base, segs = [], segs[1:]
    elif segs[0] == "super":
        base = here.split("::")[:-1] if here else []
        segs = segs[1:]
        while segs and segs[0] == "super":
            base, segs = base[:-1], segs[1:]
    else:
        return None
    best = None
    for n in range(1, len(segs) + 1):
        cand = "::".join(base + segs[:n])
        if cand in mods:
            best = cand
    return best

edges = {m: set() for m in mods}
for m, text in mods.items():
    code = re.sub(r"#\[cfg\(test\)\]\s*mod tests \{.*", "", text, flags=re.S)
    code = "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("//", "pub use", "pub(crate) use")))
    for path in re.findall(r"\b((?:crate|super)(?:::\w+)+)", code):
        t = resolve(m, path)
        # A parent naming its own child is declaring it, not depending on it.
        if t and t != m and not t.startswith(m + "::"):
            edges[m].add(t)

cycles, seen = [], set()
def dfs(node, stack, on):
    for n in sorted(edges[node]):
        if n in on:
            cyc = stack[stack.index(n):] + [n]
            key = frozenset(cyc)
            if key not in seen:
                seen.add(key)
                cycles.append(cyc)
        elif n not in visited:
            visited.add(n)
            dfs(n, stack + [n], on | {n})
visited = set()
for m in sorted(mods):
    if m not in visited:
        visited.add(m)
        dfs(m, [m], {m})
for c in cycles:
    print("cycle:", " -> ".join(c or ["crate"]))
print(f"{len(mods)} modules, {sum(len(e) for e in edges.values())} edges, {len(cycles)} cycles")
sys.exit(1 if cycles else 0)
