"""No module of ``rltk.tinker_service`` imports one that imports it back, at module level or inside a
function (the app and its routes used to: ``app.create_app`` imported ``routes``, which imported
``app``)."""

from __future__ import annotations

from tests.test_layers import edges


def test_no_module_of_the_tinker_service_reaches_itself():
    graph = {name: {t for t in out if t.startswith("rltk.tinker_service")}
             for name, out in edges().items() if name.startswith("rltk.tinker_service")}
    circles = []
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            name = stack.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                stack.extend(graph.get(name, ()))
    assert not circles, f"modules that import themselves back (through any chain): {sorted(circles)}"
