"""No import cycle anywhere in peerd: import-linter's layer contracts only see imports across layers."""

from __future__ import annotations

import grimp


def _cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge found by a depth-first walk, as the cycle it closes."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(imports.get(module, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target in imports and target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(imports):
        if module not in state:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_peerd_has_no_import_cycle():
    graph = grimp.build_graph("peerd")
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert _cycles(imports) == []
