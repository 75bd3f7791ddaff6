"""The layers keep their direction (docs/architecture.md, issue 37).

Between crates the compiler holds it: a crate cannot name one that depends on it. Inside a crate
this test does, from the `crate::` and `super::` paths of every Rust file: at each folder, the
modules import one another without a circle, and where a folder's order is written down (the
runtime's top level and `backend/`) every import runs down that order. The Python package gets
the same check for its one rule that crosses folders: the command line imports the server, never
the reverse. A path is resolved to the longest module it names, so `use crate::a::b::Item`
counts as an import of module `a::b`; comments are ignored.
"""

from __future__ import annotations

import re
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Module names at a crate's root that are other crates re-exported (`pub use candlewick_core as
# core`) or exported macros: not modules of the crate, so not part of its layering.
EXTERNAL = {
    "src": {("core",), ("default_max_tokens",), ("backend", "kernels")},
}

# Written-down orders, lowest first: a module may import only those before it. Modules on one
# rung may import each other (their folder's check still refuses a circle). Test modules (`tests`,
# `window_tests`) may import anything beside them.
ORDERS = {
    ("src", ()): [["memory"], ["backend"], ["text"], ["generation"], ["model"], ["engine"]],
    ("src", ("backend",)): [
        ["error"],
        ["device", "host", "threads"],
        ["config"],
        ["weights"],
        ["kv_cache"],
        ["blocks"],
        ["decoder", "encoder", "vision"],
        ["session"],
        ["provider"],
    ],
}
TEST_MODULES = {"tests", "window_tests"}

CRATES = {
    "src": REPO / "src",
    "crates/candlewick-core/src": REPO / "crates" / "candlewick-core" / "src",
    "crates/candlewick-kernels/src": REPO / "crates" / "candlewick-kernels" / "src",
    "bindings/python/src": REPO / "bindings" / "python" / "src",
}


def modules(root: Path) -> dict[tuple[str, ...], Path]:
    """Every module of a crate by its path (`lib.rs` is `()`, `a/mod.rs` and `a.rs` are `("a",)`)."""
    out = {}
    for path in root.rglob("*.rs"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] in ("mod", "lib"):
            parts = parts[:-1]
        out[tuple(parts)] = path
    return out


def imports(root: Path, external: set) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(importing module, imported module) for every `crate::` / `super::` path of the crate."""
    mods = modules(root)
    out = []
    for module, path in mods.items():
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for m in re.finditer(r"\b(crate|super(?:::super)*)((?:::[a-z_][a-z0-9_]*)+)", text):
            head, tail = m.group(1), tuple(m.group(2).split("::")[1:])
            base = () if head == "crate" else module[: len(module) - head.count("super")]
            target = base + tail
            if any(target[: len(e)] == e for e in external):
                continue
            while target and target not in mods:
                target = target[:-1]
            out.append((module, target))
    return out


def sibling_edges(pairs):
    """The imports as edges between siblings: for `a::b::c` importing `a::d::e`, `b → d` in `a`."""
    edges = defaultdict(set)
    for src, dst in pairs:
        k = 0
        while k < min(len(src), len(dst)) and src[k] == dst[k]:
            k += 1
        if k == len(src) or k == len(dst):
            continue  # a module naming its own descendants, or a facade above it (checked apart)
        edges[src[:k]].add((src[k], dst[k]))
    return edges


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    found, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


@pytest.mark.parametrize("crate", sorted(CRATES))
def test_no_folder_has_a_circle_of_imports(crate):
    pairs = imports(CRATES[crate], EXTERNAL.get(crate, set()))
    bad = {"::".join(level) or "<crate root>": c for level, es in sibling_edges(pairs).items() for c in cycles(es)}
    assert not bad, f"{crate}: modules importing each other in a circle: {bad}"


@pytest.mark.parametrize("crate, level", sorted(ORDERS))
def test_imports_run_down_the_written_order(crate, level):
    rank = {name: i for i, rung in enumerate(ORDERS[crate, level]) for name in rung}
    pairs = imports(CRATES[crate], EXTERNAL.get(crate, set()))
    children = {m[len(level)] for m in modules(CRATES[crate]) if m[: len(level)] == level and len(m) > len(level)}
    unranked = children - rank.keys() - TEST_MODULES
    assert not unranked, f"{'::'.join(level) or crate}: modules missing from the written order: {unranked}"
    upward = sorted(
        f"{a} imports {b}"
        for a, b in sibling_edges(pairs).get(level, ())
        if a not in TEST_MODULES and rank[b] > rank[a]
    )
    assert not upward, f"{'::'.join(level) or crate}: imports running up the layers: {upward}"


def test_backend_modules_import_each_other_not_the_backends_facade():
    # `crate::backend::CandleBackend` inside the backend would hide which floor the item lives on.
    offenders = []
    for module, path in modules(CRATES["src"]).items():
        if module[:1] == ("backend",) and len(module) > 1 and module[1] not in TEST_MODULES:
            text = re.sub(r"//[^\n]*", "", path.read_text())
            offenders += [f"{path.relative_to(REPO)}: {m}" for m in re.findall(r"crate::backend::\{?[A-Z]\w*", text)]
    assert not offenders, offenders


def test_the_crate_graph_points_down():
    def deps(manifest):
        data = tomllib.loads((REPO / manifest).read_text())
        names = set(data.get("dependencies", {}))
        for table in data.get("target", {}).values():
            names |= set(table.get("dependencies", {}))
        return {n for n in names if n.startswith("candle")}

    # The contract names no tensor framework and nothing of ours; the kernels know candle only.
    assert deps("crates/candlewick-core/Cargo.toml") == set()
    assert deps("crates/candlewick-kernels/Cargo.toml") == {"candle-core"}
    assert deps("Cargo.toml") >= {"candlewick-core", "candlewick-kernels"}
    assert "candlewick-python" not in deps("Cargo.toml")
    assert {d for d in deps("bindings/python/Cargo.toml") if d.startswith("candlewick")} == {"candlewick"}


def test_the_server_never_imports_the_command_line():
    serve = REPO / "python" / "candlewick" / "serve"
    offenders = [
        f"{p.relative_to(REPO)}: {line.strip()}"
        for p in serve.glob("*.py")
        for line in p.read_text().splitlines()
        if re.match(r"\s*(from\s+(\.\.|candlewick\.)cli\b|import\s+candlewick\.cli\b|from\s+\.\.\s+import\s+cli\b)", line)
    ]
    assert not offenders, offenders


def test_the_bindings_leave_formats_and_defaults_to_the_runtime():
    # What a file is (GGUF, a directory) and what an omitted option means are decided once, in the
    # runtime (`ArtifactFormat`, `GenerateOptions::default`), so Python and Rust users get the same.
    offenders = []
    for path in CRATES["bindings/python/src"].glob("*.rs"):
        code = re.sub(r"//[^\n]*", "", path.read_text())
        for pattern in (r"\.extension\(\)", r"ends_with\(\"\.gguf\"\)", r"ArtifactFormat::\w+\(", r"GGUF_MAGIC"):
            offenders += [f"{path.name}: {m}" for m in re.findall(pattern, code)]
    assert not offenders, offenders
