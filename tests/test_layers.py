"""The package's structure, read from its source (docs/architecture.md): imports point down the
layers only, with no cycle; every import names something that exists (function-level ones
included, which run only on a GPU or when compiling); no private name crosses a module."""

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nvfp4_inductor"

# bottom to top: a module may import from its own layer and the layers below it
LAYERS = (
    ("base", ("format", "capability", "checkpoint_config")),
    ("reference", ("reference",)),
    ("checks", ("checks", "config")),
    ("planner", ("kernels.gemm_configs", "kernels.plan")),
    ("device code", ("kernels.device",)),
    ("kernels", ("kernels",)),
    ("ops", ("ops",)),
    ("api", ("api",)),
    ("modules", ("modules",)),
    ("templates", ("templates",)),
    ("lowerings", ("lowerings",)),
    ("io", ("io",)),
    ("whole models", ("parallel", "calibrate")),
    ("entry points", ("selfcheck", "__main__", "")),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    rest = module.removeprefix("nvfp4_inductor").removeprefix(".")
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(rest == p or (p and rest.startswith(p + ".")) for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _imports(module: str):
    """-> [(imported module, [names], line, function-level?)] of module's imports of the package."""
    tree = ast.parse(MODULES[module].read_text())
    in_function = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: relative import (the package imports absolutely)"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nvfp4_inductor":
            found.append((node.module, [a.name for a in node.names], node.lineno, id(node) in in_function))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nvfp4_inductor":
                    found.append((alias.name, [], node.lineno, id(node) in in_function))
    return found


def _edges():
    """-> {(importer, imported module)}: a name that is a submodule counts as that module."""
    edges = set()
    for module in MODULES:
        for target, names, _, _ in _imports(module):
            for name in names or [None]:
                sub = f"{target}.{name}" if name else None
                dest = sub if sub in MODULES else target
                if dest != module:
                    edges.add((module, dest))
    return edges


def test_every_import_of_the_package_resolves():
    """Each `from nvfp4_inductor... import name` names an existing module and attribute, including
    the imports inside functions, which only a GPU run or a compile would execute."""
    for module in MODULES:
        for target, names, line, _ in _imports(module):
            assert target in MODULES, f"{module}:{line}: no module {target}"
            imported = importlib.import_module(target)
            for name in (n for n in names if n != "*"):
                assert hasattr(imported, name) or f"{target}.{name}" in MODULES, \
                    f"{module}:{line}: {target} has no {name}"


def test_imports_point_down_the_layers():
    upward = sorted(f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
                    for a, b in _edges() if _layer(b) > _layer(a))
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    graph = {}
    for a, b in _edges():
        graph.setdefault(a, set()).add(b)
    state, cycle = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycle, " -> ".join(cycle[0])


# what an import inside a function may defer: a module that imports one of these when it loads
HEAVY = ("triton", "transformers", "torch._inductor", "torch.distributed")


def _imports_heavy(module: str) -> bool:
    for node in ast.parse(MODULES[module].read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if any(n == h or n.startswith(h + ".") for n in names for h in HEAVY):
            return True
    return False


def test_imports_inside_functions_only_defer_heavy_ones():
    """An import of the package written inside a function defers a module that loads Triton,
    transformers, Inductor or torch.distributed; any other belongs at the top of the module."""
    found = []
    for module in MODULES:
        for target, names, line, in_function in _imports(module):
            if in_function:
                targets = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES] or [target]
                found += [f"{module}:{line}: {t}" for t in targets if not _imports_heavy(t)]
    assert not found, "\n".join(found)


def test_no_private_name_crosses_a_module():
    """`from m import _x` and `m._x` on an imported package module are refused (a private name used
    elsewhere belongs in the module's public API, or the code in another layer)."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for target, names, line, _ in _imports(module):
            found += [f"{module}:{line}: imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nvfp4_inductor"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{module}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}")
    assert not found, "\n".join(found)


def test_templates_import_no_launcher():
    """The templates' modules and the kernel sources they render import device code only (and
    nothing above the kernels' device layer)."""
    for module in MODULES:
        if _layer(module) == _layer("nvfp4_inductor.templates"):
            assert not [t for t, *_ in _imports(module) if _layer(t) >= _layer("nvfp4_inductor.kernels")], module
    rendered = sorted((PACKAGE / "templates").glob("*.jinja"))
    assert rendered
    for path in rendered:
        imports = [line.split()[1] for line in path.read_text().splitlines()
                   if line.startswith(("from nvfp4_inductor", "import nvfp4_inductor"))]
        assert imports, path.name
        for target in imports:
            assert target in MODULES and _layer(target) == _layer("nvfp4_inductor.kernels.device"), \
                f"{path.name} imports {target}"


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_every_layer_holds_a_module(layer):
    assert any(LAYERS[_layer(m)][0] == layer for m in MODULES), f"no module in layer {layer!r}"


def _modules_holding(x, call) -> list[str]:
    """call() traced: the package modules whose functions receive x (or a tensor on its storage), in
    the order entered, a module entered again in a row counted once."""
    import sys

    import torch

    storage = x.untyped_storage().data_ptr()
    visits = []

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("nvfp4_inductor."):
            holds_x = any(isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == storage
                          for v in frame.f_locals.values())
            if holds_x and (not visits or visits[-1] != module):
                visits.append(module)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return visits


def test_x_reaches_the_kernel_through_few_modules():
    """The eager path of x below NVFP4Linear.forward (which calls kernels/gemm.linear_tiled, which
    plans once and launches): the package functions that receive x, or the operand made from it,
    lie in kernels/gemm.py, kernels/plan.py and kernels/gemm_splitk.py, each entered once, in that
    order (run here on the CPU, the kernel under the Triton interpreter; from forward on a GPU:
    the test below)."""
    import torch

    import nvfp4_inductor as nv
    from nvfp4_inductor.kernels import gemm
    from nvfp4_inductor.reference import tiled

    w = nv.quantize(torch.randn(64, 128))
    data, scale = tiled.tile(w.data, w.scale.view(torch.uint8))
    x = torch.randn(3, 128).to(torch.bfloat16)
    visits = _modules_holding(x, lambda: gemm.linear_tiled(x, data, scale, w.global_scale, None, 64, "bf16"))
    kernels = "nvfp4_inductor.kernels."
    assert visits == [kernels + "gemm", kernels + "plan", kernels + "gemm_splitk"], visits


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 100, 1000])
def test_x_reaches_the_kernel_from_forward_through_five_modules(rows):
    """NVFP4Linear.forward on a GPU, W4A16, first call (nothing bound yet) and the next ones, at
    decode, serving (no bound launch there) and prefill sizes: at most 5 package modules receive
    x on its way to the kernel launch, none twice. (A first call at decode size binds a launch
    for the next ones after its kernel ran: kernels/gemm entered again, after the launch.)"""
    import torch

    import nvfp4_inductor as nv

    torch.manual_seed(rows)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096)).to(device="cuda", dtype=torch.bfloat16).eval()
    nv.convert(model, nv.Config(activations="bf16", skip_output_head=False))
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    for call in range(3):
        with torch.no_grad():
            visits = _modules_holding(x, lambda: model(x))
        if call == 0 and visits.count("nvfp4_inductor.kernels.gemm") == 2:
            visits = visits[:visits.index("nvfp4_inductor.kernels.gemm", 2)]  # (the bind)
        assert visits[0] == "nvfp4_inductor.modules.linear", visits
        assert len(visits) <= 5 and len(set(visits)) == len(visits), visits
