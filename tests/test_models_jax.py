"""Real JAX models: a Flax NNX character transformer (``nnx.Embed``, ``nnx.MultiHeadAttention``,
``nnx.LayerNorm``, ``nnx.Linear``), an Equinox ``eqx.nn.MLP`` and a two-convolution Equinox CNN, trained in
each library's own idiom under polyamp: bf16-mixed against the library's native bf16 path, the recipes'
record of the layers they quantize (counted from the models' own modules), a checkpoint resumed in a new
process, and the doctor's rows named by module path."""

import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
flax = require("flax")
eqx = require("equinox")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp.doctor.blocks import measure, parse  # noqa: E402
from polyamp.recipe_layers import RecipeWarning  # noqa: E402

VOCAB, DIM, SEQ, BATCH = 24, 32, 12, 4
BF16 = jnp.bfloat16
# bf16 rounds each matmul operand to 8 significant bits (relative error <= 2^-9); the native paths also
# run their norms, softmax and activations in bf16 where polyamp keeps them in float32, so the two losses
# differ by a few bf16 roundings of an O(1) value: 2e-2 relative bounds it with room to spare, while a
# run in float32 or one that skipped a step lies further off (checked below)
BF16_RTOL = 2e-2


# -- the models -------------------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, dtype, rngs):
        self.ln1 = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=DIM, decode=False, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
    def __init__(self, dtype=None, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, DIM, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(dtype, rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def lm_loss(model, tokens, targets):
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def text_batches(n, seed=0):
    """The same batch ``n`` times (a step is then seen to lower the loss)."""
    t = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1))
    for _ in range(n):
        yield jnp.asarray(t[:, :-1], jnp.int32), jnp.asarray(t[:, 1:], jnp.int32)


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 8, 3, stride=2, padding=1, key=k2)
        self.head = eqx.nn.Linear(8 * 4 * 4, 10, key=k3)

    def __call__(self, x):  # one image [1, 8, 8]
        x = jax.nn.relu(self.conv1(x))
        x = jax.nn.relu(self.conv2(x))
        return self.head(x.reshape(-1))


def mlp():
    return eqx.nn.MLP(16, 4, 32, depth=3, key=jax.random.PRNGKey(0))  # four Linear layers


def eqx_loss(model, x, y):
    out = jax.vmap(model)(x).astype(jnp.float32)
    if y.dtype == jnp.int32:
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    return jnp.mean((out - y) ** 2)


def mlp_batches(n, seed=0):
    x = np.random.default_rng(seed).standard_normal((8, 16)).astype(np.float32)
    for _ in range(n):
        yield jnp.asarray(x), jnp.asarray(np.tanh(x[:, :4] * 2))


def image_batches(n, seed=0):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((8, 1, 8, 8)), rng.integers(0, 10, 8)
    for _ in range(n):
        yield jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32)


def module_paths(model, types) -> set[str]:
    """The paths of the model's own modules of ``types``: NNX by graph traversal, Equinox by pytree."""
    if isinstance(model, nnx.Module):
        return {".".join(map(str, p)) for p, node in nnx.iter_graph(model) if isinstance(node, types)}
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, types))[0]
    return {".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in p)
            for p, node in found if isinstance(node, types)}  # fmt: skip


NNX_MATMULS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
EQX_MATMULS = (eqx.nn.Linear, eqx.nn.Conv)


# -- training loops, in each library's idiom ----------------------------------------------------------
def train_nnx(model, loss_fn, steps):
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, t, y)) for t, y in text_batches(steps)]


def train_eqx(model, loss_fn, batches, steps):
    """Equinox's idiom: filter_jit, filter_value_and_grad, optax on eqx.filter(model, eqx.is_array)."""
    optim = optax.adam(3e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for x, y in batches(steps):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses


def by_hand_bf16(loss_fn):
    """Equinox's native bf16: the model's floating arrays and the inputs cast to bf16 by hand."""

    def loss(model, x, y):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        low = jax.tree.map(lambda a: a.astype(BF16), params)
        return loss_fn(eqx.combine(low, static), x.astype(BF16), y)

    return loss


def weights(model):
    state = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else eqx.filter(model, eqx.is_array)
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(state)]


STEPS = 2
EQX_MODELS = {"mlp": (mlp, mlp_batches), "cnn": (lambda: CNN(jax.random.PRNGKey(1)), image_batches)}


@pytest.fixture(scope="module")
def nnx_bf16():
    """The transformer trained under polyamp's bf16-mixed: (losses, weights); shared by the tests."""
    model = CharLM()
    losses = train_nnx(model, pa.MixedPrecision("bf16-mixed", framework="jax").autocast(lm_loss), STEPS)
    return losses, weights(model)


@pytest.fixture(scope="module")
def eqx_bf16():
    """Each Equinox model trained under polyamp's bf16-mixed, through filter_jit and
    filter_value_and_grad: name -> (losses, weights)."""
    out = {}
    for name, (make, batches) in EQX_MODELS.items():
        mp = pa.MixedPrecision("bf16-mixed", framework="jax")
        model, losses = train_eqx(make(), mp.autocast(eqx_loss), batches, STEPS)
        out[name] = losses, weights(model)
    return out


# -- (a) bf16-mixed against the native bf16 paths -----------------------------------------------------
def test_nnx_transformer_bf16_mixed_matches_flax_bf16_dtype(nnx_bf16):
    ours, _ = nnx_bf16
    native = train_nnx(CharLM(dtype=BF16), lm_loss, STEPS)
    np.testing.assert_allclose(ours, native, rtol=BF16_RTOL)
    assert ours[-1] < ours[0]  # the step was taken (the same batch each step)


@pytest.mark.parametrize("name", list(EQX_MODELS))
def test_equinox_bf16_mixed_matches_casting_by_hand_under_filter_transforms(name, eqx_bf16):
    # before: mp.autocast(loss)(model, ...) raised a TypeError (a custom_jvp leaf: jax.nn.relu)
    make, batches = EQX_MODELS[name]
    ours, _ = eqx_bf16[name]
    _, native = train_eqx(make(), by_hand_bf16(eqx_loss), batches, STEPS)
    np.testing.assert_allclose(ours, native, rtol=BF16_RTOL)
    assert ours[-1] < ours[0]


# -- (b) recipes: the record of what they quantize ------------------------------------------------------
def check_record(record, layers: set[str], last: str):
    assert set(record.quantized) | set(record.kept) == layers and not set(record.quantized) & set(record.kept)
    assert sorted(record.kept.values()) == ["keep 'first'", "keep 'last'"]
    assert record.kept[last] == "keep 'last'"
    assert len(record.quantized) == len(layers) - 2


def differs(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(a, b))


def test_recipes_quantize_the_nnx_transformers_linear_layers(nnx_bf16):
    # before: every dot had scope '' and keep=first|last kept it: trained bit-identical to bf16-mixed
    layers = module_paths(CharLM(), NNX_MATMULS)
    assert len(layers) == 2 * 6 + 1  # q, k, v, out, up, down per block, and the head
    mp = pa.MixedPrecision("fp8-tensorwise", framework="jax")
    quantized = CharLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)  # it quantizes layers: no warning
        train_nnx(quantized, mp.autocast(lm_loss), STEPS)
    check_record(mp.recipe_layers, layers, "head")
    assert differs(weights(quantized), nnx_bf16[1])


@pytest.mark.parametrize("name", list(EQX_MODELS))
def test_recipes_quantize_the_equinox_linear_and_conv_layers(name, eqx_bf16):
    # before: eqx.nn.Linear's vmapped W @ x never matched the dense pattern, even with keep=
    make, batches = EQX_MODELS[name]
    layers = module_paths(make(), EQX_MATMULS)
    assert len(layers) == (4 if name == "mlp" else 3)
    # per-tensor scales compile fastest; the block layouts of eqx.nn.Linear's vmapped W @ x:
    # test_jax_recipes.py::test_the_dense_forms_of_real_layers_are_the_same_quantized_gemm
    mp = pa.MixedPrecision("fp8-tensorwise", framework="jax")
    quantized, _ = train_eqx(make(), mp.autocast(eqx_loss), batches, STEPS)
    check_record(mp.recipe_layers, layers, "layers.3" if name == "mlp" else "head")
    assert differs(weights(quantized), eqx_bf16[name][1])
    everything = pa.MixedPrecision("nvfp4:keep=:grad_rounding=nearest", framework="jax")
    eqx.filter_eval_shape(everything.autocast(eqx_loss), make(), *next(batches(1)))  # recorded at the trace
    assert sorted(everything.recipe_layers.quantized) == sorted(layers) and not everything.recipe_layers.kept


# -- (c) a checkpoint resumed in a new process --------------------------------------------------------
RESUME = textwrap.dedent('''
    """An Equinox MLP under fp8-delayed (amax histories in the checkpoint): two steps from a checkpoint."""
    import pickle, sys
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
    import polyamp as pa
    from polyamp.jax import step_if_finite

    SPEC, OPT = "fp8-delayed:history_len=4", optax.adam(3e-3)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def fresh():
        return eqx.nn.MLP(16, 4, 32, depth=3, key=jax.random.PRNGKey(0))

    def batch(i):
        x = np.random.default_rng(i).standard_normal((8, 16)).astype(np.float32)
        return jnp.asarray(x), jnp.asarray(np.tanh(x[:, :4] * 2))

    def make_step(mp):
        vg = mp.value_and_grad(mp.autocast(loss))

        @eqx.filter_jit
        def step(model, opt_state, state, x, y):
            (_, grads), finite, state = vg(model, x, y, state=state)
            model, opt_state = step_if_finite(finite, OPT, grads, opt_state, model)
            return model, opt_state, state

        return step

    def train(step, model, opt_state, state, steps):
        for i in steps:
            model, opt_state, state = step(model, opt_state, state, *batch(i))
        return model, opt_state, state

    def arrays(model):
        return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]

    def save(path, mp, model, opt_state, state):
        mp.sync(state)
        with open(path, "wb") as f:
            pickle.dump({"mp": mp.state_dict(), "model": arrays(model), "opt": jax.device_get(opt_state)}, f)

    def resume(path):
        with open(path, "rb") as f:
            saved = pickle.load(f)
        mp = pa.MixedPrecision(SPEC, framework="jax")
        mp.load_state_dict(saved["mp"])
        params, static = eqx.partition(fresh(), eqx.is_array)
        params = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(a) for a in saved["model"]])
        opt_state = jax.tree.map(jnp.asarray, saved["opt"])
        return mp, eqx.combine(params, static), opt_state, mp.init()

    if __name__ == "__main__":
        mp, model, opt_state, state = resume(sys.argv[1])
        model, _, state = train(make_step(mp), model, opt_state, state, range(2, 4))
        np.savez(sys.argv[2], *arrays(model), calls=np.asarray(mp.sync(state).steps))
''')


def test_an_equinox_checkpoint_resumes_bit_identically_in_a_new_process(tmp_path):
    # mp.value_and_grad and step_if_finite on a whole Equinox module (before: a TypeError, the custom_jvp
    # leaf jax.nn.relu), fp8-delayed's amax histories in mp.state_dict(), a new process resuming from them
    script = tmp_path / "resume_eqx.py"
    script.write_text(RESUME)
    namespace = {"__name__": "resume_eqx"}
    exec(compile(RESUME, str(script), "exec"), namespace)  # the same code as the new process runs
    mp = pa.MixedPrecision(namespace["SPEC"], framework="jax")
    model = namespace["fresh"]()
    opt_state = namespace["OPT"].init(eqx.filter(model, eqx.is_array))
    state = mp.init(mp.autocast(namespace["loss"]), model, *namespace["batch"](0))
    step = namespace["make_step"](mp)  # one compilation for the four steps here
    model, opt_state, state = namespace["train"](step, model, opt_state, state, range(2))
    namespace["save"](tmp_path / "ckpt.pkl", mp, model, opt_state, state)
    assert pickle.loads((tmp_path / "ckpt.pkl").read_bytes())["mp"]["recipe"]["state"]["delayed"]
    model, _, state = namespace["train"](step, model, opt_state, state, range(2, 4))
    assert isinstance(model, eqx.nn.MLP) and model.activation is jax.nn.relu  # its functions passed through
    assert mp.recipe_layers.quantized == ["layers.1", "layers.2"]
    src = str(Path(pa.__file__).parents[1])
    subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt.pkl"), str(tmp_path / "out.npz")],
                   check=True, timeout=120, env={"PYTHONPATH": src, "JAX_PLATFORMS": "cpu",
                                                 "PATH": "/usr/bin:/bin"})  # fmt: skip
    resumed = np.load(tmp_path / "out.npz")
    here = namespace["arrays"](model)
    assert len(here) == 8 and int(resumed["calls"]) == int(mp.sync(state).steps) == 4
    assert all(a.tobytes() == resumed[f"arr_{i}"].tobytes() for i, a in enumerate(here))


# -- (d) the doctor, by module path -------------------------------------------------------------------
def test_the_doctor_names_nnx_rows_by_module_path(tmp_path):
    model = CharLM()
    tokens, targets = next(text_batches(1))
    report = pa.doctor(model, (tokens, targets), lambda m, b: lm_loss(m, *b))
    rows = {(r.layer, r.kind): r for r in report.rows}
    layers = {layer for layer, _ in rows}
    assert module_paths(model, NNX_MATMULS) <= layers and {"embed", "blocks.0.ln1", "blocks.1.attn"} <= layers
    assert not any("->" in layer or "/" in layer for layer in layers)  # no einsum strings, no leaf paths
    # weights grouped by module: a LayerNorm's scale and bias are one row; outputs and gradients per module
    assert rows["blocks.0.ln1", "weight"].total == 2 * DIM
    assert rows["blocks.0.attn.query", "weight"].total == DIM * DIM + DIM
    for layer in ("blocks.0.attn.query", "blocks.0.ln1", "blocks.1.attn", "blocks.1"):
        assert (layer, "output") in rows and (layer, "grad_output") in rows, layer
    # the same names for keep_fp32 and the recipes' keep
    mp = pa.MixedPrecision("fp8-tensorwise:keep=blocks.0.attn.*", framework="jax",
                           keep_fp32=("blocks.1.ln1",))  # fmt: skip
    jax.eval_shape(mp.autocast(lm_loss), model, tokens, targets)  # traced: the record made, keep_fp32 matched
    assert {k for k, why in mp.recipe_layers.kept.items() if why == "keep 'blocks.0.attn.*'"} == {
        f"blocks.0.attn.{p}" for p in ("query", "key", "value", "out")}
    paths = report.write(tmp_path, plot=False)  # numpy bools in the rows crashed json.dump before
    assert paths["json"].exists() and "blocks.0.attn.query" in paths["json"].read_text()


def test_the_doctor_takes_an_equinox_module_with_a_row_per_layer(tmp_path):
    # before: refused (a custom_jvp leaf); flattened, the four Linear layers were one 'eqx.nn.MLP/...' row
    model, (x, y) = mlp(), next(mlp_batches(1))
    report = pa.doctor(model, (x, y), lambda m, b: eqx_loss(m, *b), optimizer=optax.adam(1e-3),
                       formats=("bf16", "recipe:mxfp8"))  # fmt: skip
    rows = {(r.layer, r.kind): r for r in report.rows}
    # the MLP's own equations (its activations) are the root module's row, named by its class
    assert {layer for layer, _ in rows} == {"MLP", *(f"layers.{i}" for i in range(4))}
    cast = parse("recipe:mxfp8").casts["weight"]
    for i, (n_in, n_out) in enumerate([(16, 32), (32, 32), (32, 32), (32, 4)]):
        assert rows[f"layers.{i}", "weight"].total == n_in * n_out + n_out
        assert (f"layers.{i}", "grad_output") in rows
        # the recipe measures the weight alone (not the bias), (out, in) as W @ x blocks it: along in
        want = measure(np.asarray(model.layers[i].weight), cast).to_json()
        assert rows[f"layers.{i}", "weight"].measured["recipe:mxfp8"] == pytest.approx(want)
    # and the activations that are a Linear's input: the MLP's relu outputs, not the final output
    assert "recipe:mxfp8" in rows["MLP", "output"].measured
    assert report.write(tmp_path, plot=False)["json"].exists()
