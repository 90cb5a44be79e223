"""The package's shape: an acyclic import graph, storage that never sees a policy, a driver (engine,
memory, runner) that names no policy, and one meaning per name."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rmm import config, engine, recording
from rmm.policies import POLICIES, registry, select
from rmm.policies.window import Window

RMM = Path(__file__).resolve().parents[1] / "rmm"
DRIVERS = ("rmm.engine", "rmm.memory", "rmm.runner")


def module_name(path: Path) -> str:
    parts = path.relative_to(RMM.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in RMM.rglob("*.py")}


def parse(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))


def imports(name: str) -> set[str]:
    """The rmm modules that module ``name`` imports anywhere: at the top, in functions and in
    ``if TYPE_CHECKING:`` blocks alike. ``from P import x`` counts as P.x when that is a module, else P."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(parse(name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {target for target in targets if target in MODULES}
    return found - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                return path[path.index(successor) :] + [successor]
            if successor not in state and (cycle := visit(successor)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = {name: imports(name) for name in MODULES}
    assert graph["rmm.lookahead"] >= {"rmm.engine", "rmm.future"}, "the graph misses known imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def levels(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per module of an acyclic ``graph``, its longest import chain [module, ..., a module importing none]."""
    chains: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in chains:
            chains[node] = [node, *max((chain(s) for s in sorted(graph[node])), key=len, default=[])]
        return chains[node]

    return {node: chain(node) for node in graph}


def test_the_import_graph_is_at_most_ten_levels_deep():
    assert len(levels({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}})["a"]) == 3
    deepest = max(levels({name: imports(name) for name in MODULES}).values(), key=len)
    assert len(deepest) <= 10, " -> ".join(deepest)


def test_no_module_imports_another_only_for_an_exception():
    """An exception a module raises lives in rmm.errors, not in a module imported for nothing else."""
    for name in MODULES:
        taken: dict[str, set[str]] = {}
        for node in ast.walk(parse(name)):
            if isinstance(node, ast.ImportFrom) and node.module in MODULES and not node.level:
                taken.setdefault(node.module, set()).update(alias.name for alias in node.names)
        for module, names in taken.items():
            only_errors = all(n.endswith(("Error", "Exception")) for n in names)
            assert module == "rmm.errors" or not only_errors, f"{name} imports {module} only for {names}"


def test_memory_imports_nothing_from_the_policies():
    """Not even through the modules it imports: the memory never sees a policy."""
    graph = {name: imports(name) for name in MODULES}
    seen, todo = set(), ["rmm.memory"]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    policies = {m for m in seen if m == "rmm.policies" or m.startswith("rmm.policies.")}
    assert not policies


@pytest.mark.parametrize("name", DRIVERS)
def test_drivers_name_no_policy(name):
    """No import of a policy's module, no policy class, and no string that is a policy's name."""
    modules = {cls.__module__ for cls in POLICIES.values()}
    classes = {cls.__name__ for cls in POLICIES.values()}
    tree = parse(name)
    identifiers = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    identifiers |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    identifiers |= {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not imports(name) & modules
    assert not identifiers & classes
    assert not strings & set(POLICIES)


def defined_types(name: str) -> set[str]:
    """Classes and CamelCase type aliases (``Alias = Callable[...]``) defined at the top of a module."""
    names = set()
    for node in parse(name).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {
                t.id for t in node.targets if isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][a-z]\w*", t.id)
            }
    return names


def test_types_have_one_meaning_each():
    """No two modules of the package define a class or type alias of the same name."""
    where: dict[str, list[str]] = {}
    for name in MODULES:
        for defined in defined_types(name):
            where.setdefault(defined, []).append(name)
    assert "ReferencePass" in where and "SlotMemory" in where, "the scan misses known definitions"
    assert {defined: mods for defined, mods in where.items() if len(mods) > 1} == {}


def test_the_stream_options_are_defined_once_and_checked_without_torch():
    """rmm/options.py holds the allowed values (no other module has its own copy) and the config check runs
    it before torch is imported."""
    from rmm import options

    for module in (config, recording, select, engine):
        for name in ("POSITIONS", "SCOPES", "ALLOCATIONS", "LAYERS"):
            assert getattr(module, name, getattr(options, name)) is getattr(options, name), (module, name)
    code = "import sys, rmm.config, rmm.options; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_refuses_two_policies_with_one_name():
    class Other(Window):
        pass

    with pytest.raises(ValueError, match="two policies are named 'window': Window and Other"):
        registry([Window, Other])


def test_a_policy_without_its_abstract_methods_is_refused_when_built():
    from dataclasses import dataclass

    from rmm.policies import ScorePolicy

    @dataclass
    class NoScore(ScorePolicy):
        name = "no_score"

    with pytest.raises(TypeError, match="abstract method score"):
        NoScore(budget=8, chunk=2)


def test_studies_import_only_the_library_and_their_own_folder():
    """A study imports rmm and its own folder's modules: no other study, no check."""
    studies = RMM.parent / "studies"
    for path in studies.rglob("*.py"):
        own = f"studies.{path.relative_to(studies).parts[0]}"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                mine = name == own or name.startswith(f"{own}.")
                foreign = name.startswith(("studies.", "checks.")) and not mine or name == "checks"
                assert not foreign, f"{path.relative_to(RMM.parent)} imports {name}"
