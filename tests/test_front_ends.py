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
CORE = ["errors", "policy", "presets", "scaling", "step", "native", "frameworks", "mixed_precision", "eager",
        "numerics"]  # fmt: skip
SHARED_METHODS = ("backward", "step", "watch", "autocast")
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


def imports_of(path: Path) -> set[str]:
    """The polyamp modules ``path`` imports (relative imports resolved)."""
    package = ["polyamp", *path.relative_to(SRC).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("polyamp"))
    return found


def test_dependencies_point_from_the_front_ends_to_the_core():
    fronts = [*FRAMEWORKS, "compare", "backends"]
    for core in CORE:
        files = sorted((SRC / core).glob("*.py")) if (SRC / core).is_dir() else [SRC / f"{core}.py"]
        for path in files:
            for target in imports_of(path):
                head = target.split(".")[1] if "." in target else ""
                assert head not in fronts, f"core module {path.name} imports {target}"
    for name in [*FRAMEWORKS, "keras"]:  # polyamp.keras: Keras's vocabulary, which the TensorFlow one shares
        allowed = {name, "keras"} if name == "tensorflow" else {name}
        for path in sorted((SRC / name).glob("*.py")):
            for target in imports_of(path):
                head = target.split(".")[1] if "." in target else ""
                assert head not in [f for f in [*fronts, "keras"] if f not in allowed], \
                    f"{name}/{path.name} imports {target}"


OLD_PATHS = [("polyamp.backends.jax", "polyamp.jax", "step_if_finite"),
             ("polyamp.backends.jax_autocast", "polyamp.jax.autocast", "AutocastRules"),
             ("polyamp.backends.tensorflow", "polyamp.tensorflow", "LossScaleLogger"),
             ("polyamp.training", "polyamp.mixed_precision", "MixedPrecision")]  # fmt: skip


@pytest.fixture(scope="module")
def old_path_runs():
    """One fresh interpreter per old path, all started at once: each imports the new module, then the
    old one, and prints whether they hold the same object and the DeprecationWarnings raised."""
    runs = {}
    for old, new, name in OLD_PATHS:
        code = (
            f"import warnings\nwarnings.simplefilter('always')\nimport {new}\n"
            f"with warnings.catch_warnings(record=True) as w:\n    import {old} as old\n"
            f"print(old.{name} is {new}.{name},\n"
            "      [str(x.message) for x in w if x.category is DeprecationWarning])"
        )
        runs[old] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
    yield runs
    for proc in runs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize(("old", "new", "name"), OLD_PATHS)
def test_the_old_module_paths_still_import_with_a_deprecation_warning(old, new, name, old_path_runs):
    require("jax" if "jax" in new else "keras" if "tensorflow" in new else "numpy")
    out, err = old_path_runs[old].communicate(timeout=300)
    assert old_path_runs[old].returncode == 0, err
    assert out.strip().splitlines()[-1] == f"True ['{old} moved to {new}']"


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
