"""The package's import structure: no cycle anywhere, every layer imports only from layers below it,
and the public import paths users rely on keep working.

Imports are read from the source (ast), at module level, inside functions and under TYPE_CHECKING
alike: a cycle that only a lazy import hides is still a cycle in the design.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layers, bottom to top; a module may import its own layer and the ones before it. Names are module
# prefixes; the most specific prefix decides a module's layer.
LAYERS = [
    ["rlengine.model.config", "rlengine.config", "rlengine.model.ext", "rlengine.telemetry", "rlengine.analysis",
     "rlengine.plots"],
    ["rlengine.kernels"],
    ["rlengine.model"],
    ["rlengine.engine"],
    ["rlengine.rl.rollout_group", "rlengine.rl.distributed", "rlengine.rl.child_lifetime"],
    ["rlengine.rl.algo"],
    ["rlengine.rl.data"],
    ["rlengine.rl.env"],
    ["rlengine.rl.config"],
    ["rlengine.plan.specs"],
    ["rlengine.rl.rollout"],
    ["rlengine.rl.learner"],
    ["rlengine.plan"],
    ["rlengine.rl.trainer", "rlengine.rl"],
    ["rlengine.tune", "rlengine.benchmarks", "rlengine.serve"],
    ["rlengine.cli", "rlengine.__main__", "rlengine"],
]


def _modules() -> dict[str, Path]:
    mods = {}
    for base, prefix in ((ROOT / "rlengine", "rlengine"), (ROOT / "kernels", "rlengine.kernels")):
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((prefix,) + parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """rlengine modules `name` imports (an imported package counts as its __init__)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. A package's own submodules importing it through
    `from package import x` is not counted: Python resolves that to the submodule."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if v.startswith(w + "."):  # a module importing its parent package (its __init__)
                continue
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def layer_of(module: str) -> int:
    best, layer = "", None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, layer = p, i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, deps in graph.items():
        for b in deps:
            if a.startswith(b + "."):
                continue  # a package's __init__ re-exporting its own parts is not a layer edge
            if layer_of(b) > layer_of(a):
                bad.append(f"{a} -> {b}")
    return sorted(bad)


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_no_module_imports_from_a_layer_above_it():
    assert upward_imports(import_graph()) == []


def test_the_checks_catch_a_planted_cycle_and_an_upward_import():
    graph = import_graph()
    graph["rlengine.rl.data.rewards"] = graph["rlengine.rl.data.rewards"] | {"rlengine.rl.data.scoring"}
    assert find_cycle(graph) is not None
    graph = import_graph()
    graph["rlengine.analysis.roofline"] = graph["rlengine.analysis.roofline"] | {"rlengine.rl.data.tasks"}
    assert upward_imports(graph) == ["rlengine.analysis.roofline -> rlengine.rl.data.tasks"]


def test_the_graph_reads_imports_inside_functions_and_type_checking_blocks():
    graph = import_graph()
    assert "rlengine.rl.data.tasks" in graph["rlengine.rl.data.scoring"]        # under TYPE_CHECKING
    assert "rlengine.rl.trainer.loop" in graph["rlengine.rl.trainer"]           # package re-export
    assert "rlengine.rl.config" in graph["rlengine.rl"]                         # inside a function


# The public import paths, and (second block) the old paths that README, docs and tests used before the
# package root was reorganised, kept as re-exports.
@pytest.mark.parametrize("path, names", [
    ("rlengine", ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]),
    ("rlengine.engine", ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]),
    ("rlengine.model", ["Qwen3ForCausalLM", "load_pretrained", "save_pretrained", "load_model_config",
                        "CheckpointError"]),
    ("rlengine.model.config", ["ModelConfig", "ConfigError", "PRESETS", "preset"]),
    ("rlengine.rl", ["Trainer", "TrainConfig", "load_job_config"]),
    ("rlengine.rl.trainer", ["Trainer"]),
    ("rlengine.rl.config", ["TrainConfig", "TrainSection", "GenSection", "load_job_config", "packaged_config"]),
    ("rlengine.rl.learner", ["Learner", "TrainBatch"]),
    ("rlengine.tune", ["tune"]),
    ("rlengine.cli", ["main", "build_parser"]),
    # old paths
    ("rlengine.config", ["ModelConfig", "ConfigError", "PRESETS", "preset"]),
    ("rlengine.model", ["load_config"]),
    ("rlengine.rl", ["load_config"]),
    ("rlengine.rl.config", ["load_config"]),
])
def test_public_import_paths(path, names):
    module = importlib.import_module(path)
    for n in names:
        assert hasattr(module, n), f"{path}.{n}"
    if path == "rlengine.rl":
        from rlengine.rl.trainer.loop import Trainer
        assert module.Trainer is Trainer


def test_the_package_root_holds_only_the_layers():
    """model, engine, rl, plan, tune, analysis, telemetry, benchmarks, cli (and plots, configs): no loose
    modules but the package's own __init__ / __main__ and the rlengine.config compatibility path."""
    loose = sorted(p.name for p in (ROOT / "rlengine").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "config.py"]
    assert "compatibility" in (ROOT / "rlengine" / "config.py").read_text().lower()
