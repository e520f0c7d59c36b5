"""One front end per framework over one core: what ``MixedPrecision`` returns, how an unbound one
binds, which idiom belongs to which framework, and which way the imports point."""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from frameworks import require

import polyamp as pa
from polyamp import PolyampError
from polyamp.frameworks import FRAMEWORKS, IDIOMS

SRC = Path(pa.__file__).parent
SHARED_METHODS = ("backward", "step", "watch", "autocast", "optimizer")
IN_THIS_VENV = [f for f in FRAMEWORKS if f != "mxnet"]


def front_end(name):
    require({"tensorflow": "keras"}.get(name, name))
    return importlib.import_module(f"polyamp.{name}").MixedPrecision


@pytest.mark.parametrize("name", IN_THIS_VENV)
def test_mixed_precision_returns_the_framework_s_own_object(name):
    cls = front_end(name)
    mp = pa.MixedPrecision("bf16-mixed", framework=name)
    assert type(mp) is cls and isinstance(mp, pa.MixedPrecision) and mp.framework == name
    assert cls("bf16-mixed").framework == name  # the class itself needs no framework=
    other = next(f for f in IN_THIS_VENV if f != name)
    with pytest.raises(PolyampError, match=f"framework='{other}', but this is polyamp.{name}'s"):
        cls("bf16-mixed", framework=other)


PRINT_FRAMEWORKS = (
    "print(','.join(m for m in ('torch', 'tensorflow', 'jax', 'mxnet', 'keras') if m in sys.modules))"
)


def imported_after(*codes: str) -> list[list[str]]:
    """The frameworks in ``sys.modules`` after each of ``codes``, each run in a fresh interpreter (the
    interpreters run side by side)."""
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys\n{code}\n{PRINT_FRAMEWORKS}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for code in codes]  # fmt: skip
    found = []
    for proc, code in zip(procs, codes):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (code, err)
        found.append(out.strip().splitlines()[-1].split(","))
    return found


@pytest.mark.parametrize("name", IN_THIS_VENV)
def test_a_front_end_imports_its_own_framework_only(name):
    front_end(name)
    native = {"torch": "import torch", "jax": "import jax", "tensorflow": "import tensorflow, keras"}[name]
    ours, theirs = imported_after(f"import polyamp.{name}", native)
    assert ours == theirs and name in ours
    others = {"torch": {"tensorflow", "jax", "mxnet"}, "jax": {"torch", "tensorflow", "mxnet"},
              "tensorflow": {"torch", "mxnet"}}[name]  # fmt: skip
    assert not others & set(ours)


def test_with_one_framework_imported_the_factory_picks_it():
    require("torch")
    code = "import torch, polyamp as pa\nprint(type(pa.MixedPrecision('bf16-mixed')).__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "polyamp.torch"


def test_an_unbound_one_becomes_the_framework_s_object_and_keeps_its_state():
    torch = require("torch")
    require("jax")  # two frameworks imported: the factory cannot choose
    saved = pa.MixedPrecision("fp16-mixed", framework="torch")
    saved.state = saved.loss_scale.update(saved.state, False)
    mp = pa.MixedPrecision("fp16-mixed")
    assert type(mp).__name__ == "_Unbound" and mp.framework is None
    mp.load_state_dict(saved.state_dict())
    model = torch.nn.Linear(3, 1)
    assert mp.watch(model) is model
    assert type(mp) is front_end("torch") and mp.state == saved.state and mp.current_scale == 2.0**15
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.backward(model(torch.ones(2, 3)).sum())
    assert mp.step(opt).stepped


def test_an_unbound_one_binds_to_keras_at_scope_and_its_variables_take_the_state():
    require("keras")
    require("torch")
    saved = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    saved.state = saved.loss_scale.update(saved.state, False)
    mp = pa.MixedPrecision("fp16-mixed")
    mp.load_state_dict(saved.state_dict())
    with mp.scope():
        pass
    assert type(mp) is front_end("tensorflow")
    assert float(mp.loss_scale_variables().scale.numpy()) == 2.0**15 and mp.state == saved.state


def test_an_unbound_one_binds_to_jax_at_autocast_of_a_function():
    jnp = require("jax.numpy")
    require("torch")
    mp = pa.MixedPrecision("bf16-mixed")
    f = mp.autocast(lambda x: (x @ x).sum())
    assert type(mp) is front_end("jax") and f(jnp.ones((2, 2))).dtype == jnp.float32


def test_an_unbound_one_refuses_what_tells_no_framework():
    require("torch")
    require("jax")
    mp = pa.MixedPrecision("bf16-mixed")
    with pytest.raises(PolyampError, match="must be handed a tensor/model/optimizer .* got builtins.object"):
        mp.watch(object())
    with pytest.raises(AttributeError, match="no attribute 'scoop'"):
        mp.scoop()
    assert hasattr(mp, "scope") and hasattr(mp, "init")  # looking an idiom up binds nothing
    assert mp.framework is None and type(mp).__name__ == "_Unbound"


def test_the_idiom_table_matches_the_front_ends():
    """Each name in IDIOMS is defined by its framework's class only; the shared ones by the eager
    front ends (and autocast/watch by JAX/Keras as their idioms have them)."""
    classes = {name: front_end(name) for name in IN_THIS_VENV}
    for method, owner in IDIOMS.items():
        if owner in classes:
            assert callable(getattr(classes[owner], method)), (method, owner)
        for name, cls in classes.items():
            if name != owner:
                assert method not in dir(cls), (method, name)
    for method in SHARED_METHODS:
        assert method not in IDIOMS and not hasattr(pa.MixedPrecision, method)
    assert {m for m in SHARED_METHODS if hasattr(classes["torch"], m)} == set(SHARED_METHODS)


def test_another_framework_s_idiom_is_a_clear_error_and_not_an_attribute():
    require("torch")
    mp = pa.MixedPrecision("bf16-mixed", framework="torch")
    with pytest.raises(PolyampError, match=r"scope\(\) is the tensorflow idiom; this MixedPrecision drives "
                                           r"torch.*framework='tensorflow'"):  # fmt: skip
        mp.scope()
    assert not hasattr(mp, "init") and not hasattr(mp, "trainer")
    jax_mp = pa.MixedPrecision("bf16-mixed", framework="jax")
    with pytest.raises(PolyampError, match="JAX is functional: instead of mp.step"):
        jax_mp.step(None)


FRONT_ENDS = (*FRAMEWORKS, "keras")  # polyamp.keras: Keras's vocabulary, which the TensorFlow one shares
# entry points over the front ends: the commands, the comparison, the host trainers' public paths
TOP = ("compare", "cli", "lightning", "hf", "accelerate", "__main__")


def module_name(path: Path) -> str:
    parts = ["polyamp", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """'core', a front end's name, or 'top' for a module ``polyamp.<head>...``."""
    head = module.split(".")[1] if "." in module else ""
    return head if head in FRONT_ENDS else "top" if head in TOP else "core"


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path) -> set[str]:
    """The polyamp modules ``path`` imports when it runs (at import time or inside a function; relative
    imports resolved; ``if TYPE_CHECKING:`` blocks left out)."""
    package = module_name(path).split(".")
    package = package if path.name == "__init__.py" else package[:-1]
    found = set()
    todo = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if _type_checking(node):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
            found.update([target] if node.module else [f"{target}.{a.name}" for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("polyamp"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("polyamp"))
    return found


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def test_dependencies_point_from_the_top_to_the_front_ends_to_the_core():
    """The core imports only the core; a front end the core and itself (TensorFlow's also Keras's
    vocabulary, ``polyamp.keras``); the entry points anything."""
    assert {layer(m) for m in MODULES} >= {"core", "top", *FRONT_ENDS}
    for module, path in MODULES.items():
        own = layer(module)
        allowed = {"core", "top", *FRONT_ENDS} if own == "top" else {"core", own}
        if own == "tensorflow":
            allowed.add("keras")
        for target in imports_of(path):
            assert layer(target) in allowed, f"{module} ({own}) imports {target} ({layer(target)})"


def test_the_core_reaches_a_front_end_only_through_front_end_module():
    """No ``importlib`` / ``__import__`` in the core outside ``frameworks.py``, whose
    ``front_end_module`` (and ``ops_of`` over it) is the one way in."""
    for module, path in MODULES.items():
        if layer(module) != "core" or module == "polyamp.frameworks":
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        imported = {a.name for n in nodes for a in n.names}
        imported |= {n.module for n in nodes if isinstance(n, ast.ImportFrom)}
        assert "__import__" not in names and not {"importlib", "import_module"} & imported, module


def test_no_module_imports_itself_back():
    """The runtime import graph of polyamp has no cycle (a package and its submodules included)."""
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for target in imports_of(path):
            while target not in MODULES and "." in target:  # ``from .x import name``: the module x
                target = target.rsplit(".", 1)[0]
            if target != module:
                targets.add(target)
        graph[module] = targets
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_framework_keras_is_the_front_end_of_the_backend_keras_will_run_on(tmp_path):
    """Without importing Keras: KERAS_BACKEND, else $KERAS_HOME/keras.json, else TensorFlow (as Keras)."""
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    code = ("import sys; from polyamp.frameworks import canonical_framework as c; "
            "print(c('keras'), c('tf.keras'), 'keras' in sys.modules)")  # fmt: skip
    seen = []
    base = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "KERAS_HOME")}
    for env in ({"KERAS_BACKEND": "jax"}, {"KERAS_HOME": str(tmp_path)}, {"KERAS_HOME": str(tmp_path / "x")}):
        run = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                             text=True, check=True)  # fmt: skip
        seen.append(run.stdout.split())
    assert seen == [["keras", "tensorflow", "False"], ["keras", "tensorflow", "False"],
                    ["tensorflow", "tensorflow", "False"]]  # fmt: skip


def test_mxnet_front_end_alone():
    """In MXNet's environment: the factory picks MXNet, and its front end imports no other framework."""
    require("mxnet")
    code = ("import warnings\nwarnings.simplefilter('ignore')\nimport mxnet, polyamp as pa\n"
            "print(type(pa.MixedPrecision('bf16-mixed')).__module__)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "polyamp.mxnet"
    quiet = "import warnings\nwarnings.simplefilter('ignore')\n"
    assert imported_after(quiet + "import polyamp.mxnet") == [["mxnet"]]
