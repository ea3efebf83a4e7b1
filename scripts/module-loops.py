#!/usr/bin/env python3
"""Lists import cycles between the modules of a crate's library (none in any crate: gateway/tests/module_graph.rs).

Usage: scripts/module-loops.py gateway/src [--edges]

A module is a file under SRC (`a/b.rs` and `a/b/mod.rs` are `a::b`). An edge A -> B is A's code
naming B or an item of B:
- a path `crate::x::...` or `super::...` (grouped imports `super::{a, b::c}` and globs
  `super::*` included), resolved to the longest module prefix, the module itself when the path
  names one of its items;
- a parent naming a child module's items (`child::f()`, `use self::child::T`, `use child::T`):
  the parent depends on the child. A parent's `mod` declarations and re-exports (`pub use`) are
  not edges: re-exports name the API, not a dependency of the parent's own code.
So a child that imports its parent's items while the parent calls into the child is a cycle;
shared items belong in a leaf module both import. Test modules (`#[cfg(test)] mod tests`) are
left out. Prints each cycle found (with --edges, every edge) and exits 1, or says none and exits 0.
"""
import re, sys
from pathlib import Path

args = [a for a in sys.argv[1:] if not a.startswith("--")]
show_edges = "--edges" in sys.argv[1:]
src = Path(args[0] if args else "gateway/src")
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
    best = "::".join(base) if "::".join(base) in mods else None
    for n in range(1, len(segs) + 1):
        cand = "::".join(base + segs[:n])
        if cand in mods:
            best = cand
    return best

def expand(code):
    """`crate::a::{b, c::{d, self}}` and `super::*` as the plain paths they name."""
    out = []
    for m in re.finditer(r"\b((?:crate|super)(?:::(?:super|\w+))*)::\{", code):
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        inner = code[m.end():i - 1]
        for item in split_top(inner):
            item = item.strip()
            if not item:
                continue
            if item == "self" or item == "*":
                out.append(m.group(1))
            elif "{" in item:
                out.extend(expand(m.group(1) + "::" + item))
            else:
                out.append(m.group(1) + "::" + re.split(r"\s+as\s+", item)[0].strip())
    for m in re.finditer(r"\b((?:crate|super)(?:::(?:super|\w+))*)::\*", code):
        out.append(m.group(1))
    return out

def split_top(text):
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    return parts

edges = {m: set() for m in mods}
for m, text in mods.items():
    code = re.sub(r"#\[cfg\(test\)\]\s*mod tests \{.*", "", text, flags=re.S)
    code = "\n".join(l for l in code.splitlines() if not l.lstrip().startswith(("//", "pub use", "pub(crate) use", "pub(super) use")))
    # `pub(in crate::x)` names where an item is visible, not something it uses.
    code = re.sub(r"pub\(in [^)]*\)", "pub", code)
    paths = re.findall(r"\b((?:crate|super)(?:::\w+)+)", code) + expand(code)
    for path in paths:
        t = resolve(m, path)
        # A parent naming its own child by a `crate::`/`super::` path is counted below.
        if t is not None and t != m and not t.startswith(m + "::" if m else "\0"):
            edges[m].add(t)
    # A parent using its direct children's items.
    prefix = m + "::" if m else ""
    children = {c[len(prefix):] for c in mods if c.startswith(prefix) and c != m and "::" not in c[len(prefix):]}
    body = "\n".join(l for l in code.splitlines() if not re.match(r"\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*;", l))
    for c in children:
        if re.search(r"(?<![\w:])(?:self::)?" + re.escape(c) + r"::", body):
            edges[m].add(prefix + c)

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
if show_edges:
    for m in sorted(edges):
        for t in sorted(edges[m]):
            print(f"edge: {m or 'crate'} -> {t or 'crate'}")
for c in cycles:
    print("cycle:", " -> ".join(x or "crate" for x in c))
print(f"{len(mods)} modules, {sum(len(e) for e in edges.values())} edges, {len(cycles)} cycles")
sys.exit(1 if cycles else 0)
