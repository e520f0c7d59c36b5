"""Emulated fp8 / MX / NVFP4 training in Keras 3 (``polyamp/tensorflow/recipe.py``): keep lists, the GEMMs
of EinsumDense and at open dimensions, eagerly, in ``tf.function`` and XLA, delayed-scaling and
stochastic-rounding state resumed bit for bit, training in custom loops and ``fit``, and bad input (the
quantization and Dense's three GEMMs against the numpy core: test_recipes_frameworks.py)."""

import functools
import json
import warnings

import numpy as np
import pytest
from frameworks import require
from test_recipes_frameworks import core_operand as core
from test_recipes_frameworks import wide

tf = require("tensorflow")
import keras  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, recipes  # noqa: E402
from polyamp.keras.keep import named_layers  # noqa: E402
from polyamp.numerics import hadamard_tiles  # noqa: E402
from polyamp.recipe_layers import RecipeWarning  # noqa: E402
from polyamp.tensorflow import recipe as tr  # noqa: E402


def same(got, want) -> bool:
    """Bit for bit, NaN payloads aside."""
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def test_an_eager_delayed_update_runs_in_one_graph(monkeypatch):
    """Eagerly, an amax history's update (the next scale by a long division: hundreds of integer ops) is
    one ``graph_call``, not op by op, which made an eager fp8-delayed step ~3x the other recipes'."""
    eager = []
    scale = tr._scale
    monkeypatch.setattr(tr, "_scale", lambda *a: eager.append(tf.executing_eagerly()) or scale(*a))
    r = recipes.parse_recipe("fp8-delayed:history_len=3")
    q, history = tr.Quantizer(r), recipes.DelayedScaling.from_recipe(r)
    x = wide((16, 24), 8)
    for _ in range(2):
        q(tf.constant(x), "fc", "input")
        history.update(float(np.abs(x).max()))
        x = x * 5
    assert True not in eager and q.state_dict()["delayed"]["fc|input"] == history.state_dict()


def gemm_case(spec, compute=tf.float32):
    """y, dx, dw of ``linear`` on fixed operands, and the quantizer (its state after the call)."""
    r = recipes.parse_recipe(spec)
    x, w, g = wide((2, 16, 64), 3), wide((64, 96), 4) / 8, wide((32, 96), 5)
    q = tr.Quantizer(r)
    if r.kind == "delayed":
        for operand in ("input", "weight", "grad"):
            q.add("fc", operand)
    fn = tr.linear(q, "fc", compute)
    xt, wt = tf.constant(x), tf.Variable(w)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = fn(xt, wt)
    dx, dw = tape.gradient(y, [xt, wt], output_gradients=tf.constant(g.reshape(2, 16, 96)))
    return r, (x, w, g), (y, dx, dw), q


def test_products_run_in_the_compute_dtype():
    _, (x, w, g), (y, dx, dw), _ = gemm_case("mxfp8", tf.bfloat16)
    _, _, (y32, _, _), _ = gemm_case("mxfp8", tf.float32)
    assert y.dtype == tf.float32 and dw.dtype == tf.float32  # x's and w's dtypes
    assert not same(y, y32) and np.allclose(y.numpy(), y32.numpy(), rtol=0.02, atol=0.05)


# -- Keras models ----------------------------------------------------------------------------------------
def mlp(mp, dims=(16, 48, 48, 48, 4), seed=0):
    """A Sequential MLP of Dense layers fc0, fc1, ... built in ``mp.scope()``."""
    keras.utils.set_random_seed(seed)
    with mp.scope():
        dense = [keras.layers.Dense(b, activation="gelu" if i < len(dims) - 2 else None, name=f"fc{i}")
                 for i, b in enumerate(dims[1:])]  # fmt: skip
        return keras.Sequential([keras.Input((dims[0],)), *dense])


def batch(seed):
    x = np.random.default_rng(seed).standard_normal((64, 16)).astype(np.float32)
    return x, np.sin(x[:, :4])


def train(mp, model, steps, start=0):
    """``steps`` eager steps of a fresh Adam on batches ``start``, ``start + 1``, ...; their losses. Eager:
    a traced step of the emulated GEMMs costs ~30 s to trace and optimize, an eager one ~0.3 s, and the
    kernels' graphs (``graph_call``, per shape) are shared by every eager run of this module."""
    opt = keras.optimizers.Adam(1e-2)
    out = []
    for i in range(start, start + steps):
        x, y = batch(i)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))
        grads = tape.gradient(mp.scale(loss), model.trainable_variables)
        mp.apply(opt, grads, model.trainable_variables)
        out.append(float(loss))
    return out


def test_the_keep_list_keeps_first_and_last_dense_and_patterns():
    mp = pa.MixedPrecision("mxfp8", framework="tensorflow")
    model = mlp(mp)
    mp.watch(model)
    assert mp._dense.kept == ["fc0", "fc3"] and [n for n, _ in mp._dense.quantized] == ["fc1", "fc2"]
    assert tr.MatmulLayers(model, ("fc[12]",)).kept == ["fc1", "fc2"]
    assert tr.MatmulLayers(model, ()).kept == []
    a, b = keras.layers.Dense(8, name="a"), keras.layers.Dense(8, name="b")
    inner = keras.Sequential([keras.Input((16,)), a, b], name="block")
    outer = keras.Sequential([keras.Input((16,)), inner, keras.layers.Dense(4, name="head")])
    assert tr.MatmulLayers(outer, ("block",)).kept == ["block/a", "block/b"]
    assert tr.MatmulLayers(outer, ("first",)).kept == ["block/a"]
    with pytest.raises(
        PolyampError, match="keep entry 'attn\\*' matches no layer of the model; its layers: fc0"
    ):
        tr.MatmulLayers(model, ("attn*",))
    # with both layers kept, a two-layer model computes exactly as bf16-mixed
    x = batch(0)[0]
    outs = []
    for policy in ("bf16-mixed", "mxfp8", "mxfp8:keep="):
        m = pa.MixedPrecision(policy, framework="tensorflow")
        model = mlp(m, dims=(16, 32, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecipeWarning)  # mxfp8 keeps both (test below)
            m.watch(model)
        outs.append(model(x).numpy().astype(np.float32))
    assert same(outs[1], outs[0]) and not same(outs[2], outs[0])


def attention_model(mp):
    """Dense, MultiHeadAttention (four EinsumDense), a Conv1D, a transposed one and an EinsumDense whose
    equation is a product batched over a kernel axis, in one functional model."""
    keras.utils.set_random_seed(0)
    with mp.scope():
        x = keras.Input((8, 16))
        h = keras.layers.Dense(16, name="embed")(x)
        h = keras.layers.MultiHeadAttention(2, 8, name="attn")(h, h)
        h = keras.layers.Conv1D(16, 3, padding="same", name="conv")(h)
        h = keras.layers.Conv1DTranspose(16, 3, padding="same", name="up")(h)
        h = keras.layers.EinsumDense("abc,bcd->abd", (8, 16), name="per_position")(h)
        return keras.Model(x, keras.layers.Dense(4, name="head")(h))


def test_recipe_layers_record_every_matmul_layer_by_its_path():
    mp = pa.MixedPrecision("mxfp8", framework="tensorflow")
    model = attention_model(mp)
    with pytest.raises(PolyampError, match="known after mp.watch"):
        _ = mp.recipe_layers
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)
        mp.watch(model)
    record = mp.recipe_layers
    assert record.quantized == ["attn/query", "attn/key", "attn/value", "attn/attention_output", "conv"]
    assert record.kept == {
        "embed": "keep 'first'",
        "up": "unsupported: Conv1DTranspose: a transposed convolution",
        "per_position": "unsupported: EinsumDense: equation 'abc,bcd->abd': an axis in the input, the kernel "
                        "and the output (a batched product)",
        "head": "keep 'last'"}  # fmt: skip
    # every name is the doctor's and keep_fp32's, and each quantized layer runs the recipe's call
    names = {n for n, _ in named_layers(model)}
    assert set(record.quantized) | set(record.kept) <= names
    assert all("call" in vars(layer) for n, layer in named_layers(model) if n in record.quantized)
    assert all("call" not in vars(layer) for n, layer in named_layers(model) if n in record.kept)
    assert record.as_dict()["recipe"] == "mxfp8"
    # a keep pattern names its reason
    mp2 = pa.MixedPrecision("mxfp8:keep=attn*", framework="tensorflow")
    mp2.watch(attention_model(mp2))
    assert mp2.recipe_layers.quantized == ["embed", "conv", "head"]
    assert mp2.recipe_layers.kept["attn/query"] == "keep 'attn*'"
    # the attention projections compute the recipe's GEMMs: the output moves off bf16-mixed's
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    bf16 = pa.MixedPrecision("bf16-mixed", framework="tensorflow")
    plain = attention_model(bf16)
    assert not same(model(x), plain(x))
    mp3 = pa.MixedPrecision("mxfp8:keep=embed|conv|head", framework="tensorflow")
    mp3.watch(only_attn := attention_model(mp3))
    assert not same(only_attn(x), plain(x)) and mp3.recipe_layers.quantized[0] == "attn/query"


def test_a_recipe_that_quantizes_no_layer_warns():
    mp = pa.MixedPrecision("fp8-tensorwise", framework="tensorflow")
    model = mlp(mp, dims=(16, 32, 4))  # fc0 is the first Dense, fc1 the last
    with pytest.warns(RecipeWarning, match="quantizes no layer of this Keras model .*fc0: keep 'first'"):
        mp.watch(model)
    assert mp.recipe_layers.quantized == [] and mp.recipe_layers.kept == {"fc0": "keep 'first'",
                                                                          "fc1": "keep 'last'"}  # fmt: skip


# per-tensor scaling with its state (amax histories) and blocks with theirs (the stochastic-rounding
# counter) and NVFP4's 16x16 weights; fp8-tensorwise's and mxfp8's GEMMs are these with a simpler
# Quantizer (tested above), and mxfp8 trains under fit in test_models_keras.py
TRAINED = ["fp8-delayed:history_len=4", "nvfp4"]


@functools.cache
def trained(spec):
    """``spec`` on ``mlp`` (fc1 and fc2 quantized), 12 steps in a custom loop: two, the state saved then
    (as plain values) with the weights, two more and 8 more (each ``train`` with a fresh Adam); (mp,
    losses, saved state, weights at the save, weights two steps after it)."""
    mp = pa.MixedPrecision(spec, framework="tensorflow")
    model = mlp(mp)
    mp.watch(model)
    losses = train(mp, model, 2)
    saved, weights = json.loads(json.dumps(mp.state_dict())), model.get_weights()
    losses += train(mp, model, 2, start=2)
    after = model.get_weights()
    losses += train(mp, model, 8, start=4)
    return mp, losses, saved, weights, after


@pytest.mark.parametrize("spec", TRAINED)
def test_each_recipe_trains_in_a_custom_loop(spec):
    mp, losses, *_ = trained(spec)  # the last five's mean is ~0.3 of the first
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    assert mp.recipe == recipes.parse_recipe(spec) and mp.recipe_layers.quantized == ["fc1", "fc2"]


@pytest.mark.parametrize("spec", ["nvfp4", "fp8-delayed"])
def test_the_gemms_and_their_state_are_the_same_eagerly_in_tf_function_and_xla(spec):
    """Two calls (the second one's seeds and scales come from the state the first left) per mode; XLA's
    bf16 matmuls may round their sums differently from TF's kernels, the quantization may not."""
    x, w, g = wide((2, 16, 64), 3), wide((64, 96), 4) / 8, wide((32, 96), 5).reshape(2, 16, 96)
    runs = []
    for jit in (None, False, True):
        q = tr.Quantizer(recipes.parse_recipe(spec))
        for operand in ("input", "weight", "grad") if q.recipe.kind == "delayed" else ():
            q.add("fc", operand)
        fn = tr.linear(q, "fc", tf.bfloat16)
        wt = tf.Variable(w)

        def run(xt, gt, fn=fn, wt=wt):
            with tf.GradientTape() as tape:
                tape.watch(xt)
                y = fn(xt, wt)
            return (y, *tape.gradient(y, [xt, wt], output_gradients=gt))

        run = run if jit is None else tf.function(run, jit_compile=jit)
        outs = [t.numpy() for _ in range(2) for t in run(tf.constant(x), tf.constant(g))]
        runs.append((outs, q.state_dict()))
    assert not same(runs[0][0][1], runs[0][0][4])  # the state moved on
    (eager, state), (traced, traced_state), (xla, xla_state) = runs
    assert all(same(a, b) for a, b in zip(traced, eager)) and traced_state == state
    assert all(np.allclose(a, b, rtol=1e-2, atol=1e-3) for a, b in zip(xla, eager)) and xla_state == state


def test_fit_trains_with_the_recipe():
    """``fit`` with ``mp.optimizer`` and NVFP4 with the Hadamard transform (the kinds train in
    test_each_recipe_trains_in_a_custom_loop; MX blocks at an open dimension are
    test_operands_with_an_open_dimension_are_quantized_as_the_core_does's)."""
    mp = pa.MixedPrecision("nvfp4:hadamard=true", framework="tensorflow")
    model = mlp(mp, dims=(16, 48, 48, 4))
    mp.watch(model)
    assert mp.recipe_layers.quantized == ["fc1"]
    model.compile(optimizer=mp.optimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    # 64 = 2 x 24 + 16 in batches of an open batch dimension: fit traces its step once, with that
    # dimension open, blocked along in the backward (M: Hadamard tiles and blocks of the rows)
    data = tf.data.Dataset.from_tensor_slices(batch(0)).batch(24)
    history = model.fit(data, epochs=5, verbose=0)  # the fifth epoch's loss: ~0.1 of the first
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]


@pytest.mark.parametrize("spec", ["mxfp8", "nvfp4", "fp8-tensorwise:grad_rounding=stochastic"])
def test_operands_with_an_open_dimension_are_quantized_as_the_core_does(spec):
    """A step traced with a batch dimension known only when it runs (``model.fit``'s partial last
    batch) quantizes as a static shape does: blocks along it and across it, stochastic rounding."""
    r = recipes.parse_recipe(spec)
    x = wide((37, 40), 6)
    for axis in (0, -1) if r.kind == "block" else (-1,):  # a per-tensor scale has no axis
        q = tr.Quantizer(r)
        fn = tf.function(lambda t, q=q, axis=axis: q(t, "layer", "grad", axis),
                         input_signature=[tf.TensorSpec([None, 40])])  # fmt: skip
        got = fn(tf.constant(x))
        seed = int(q.calls.numpy()) if r.grad_rounding == "stochastic" else None
        assert same(got, core(x, r, "grad", axis, seed, None)), axis


@pytest.mark.parametrize("spec", TRAINED)
def test_recipe_state_resumes_bit_for_bit(spec):
    """The state saved after two steps of ``trained(spec)`` (delayed histories, the stochastic-rounding
    counter), loaded into a model of other weights given the saved ones: the next two steps are the same."""
    mp, losses, saved, weights, after = trained(spec)
    state = saved["recipe"]["state"]
    assert state["calls"] > 0 if spec.startswith("nvfp4") else state["delayed"]["fc1|grad"]["steps"] == 2
    mp2 = pa.MixedPrecision(spec, framework="tensorflow")
    model2 = mlp(mp2, seed=5)
    model2.set_weights(weights)
    mp2.watch(model2)
    mp2.load_state_dict(saved)
    assert mp2.state_dict()["recipe"] == saved["recipe"]
    assert train(mp2, model2, 2, start=2) == losses[2:4]
    assert all(same(a, b) for a, b in zip(after, model2.get_weights()))


def test_bad_input_is_one_clear_error():
    mp = pa.MixedPrecision("fp8-delayed", framework="tensorflow")
    model = mlp(mp)
    with pytest.raises(PolyampError, match="call mp.watch\\(model\\) once before training"):
        mp.optimizer(keras.optimizers.SGD())
    with pytest.raises(PolyampError, match="call mp.watch\\(model\\) once before training"):
        mp.apply(keras.optimizers.SGD(), [tf.zeros_like(v) for v in model.trainable_variables],
                 model.trainable_variables)  # fmt: skip
    state = mp.state_dict()
    state["recipe"]["state"]["delayed"] = {"fc1|input": {}}
    with pytest.raises(PolyampError, match="call mp.watch\\(model\\) before mp.load_state_dict"):
        mp.load_state_dict(state)
    mp.watch(model)
    with pytest.raises(
        PolyampError, match="holds an amax history for 'fc9\\|input', which this model has not"
    ):
        state["recipe"]["state"]["delayed"] = {"fc9|input": {}}
        mp.load_state_dict(state)
    with pytest.raises(PolyampError, match="lacks"):
        state["recipe"]["state"]["delayed"] = {"fc1|input": {}}
        mp.load_state_dict(state)
    with pytest.raises(PolyampError, match="calls must be an integer >= 0"):
        state["recipe"]["state"] = {"calls": -1, "delayed": {}}
        mp.load_state_dict(state)
    with pytest.raises(PolyampError, match="saved with recipe 'fp8-delayed', this run uses 'mxfp8'"):
        pa.MixedPrecision("mxfp8", framework="tensorflow").load_state_dict(mp.state_dict())
    with pytest.raises(PolyampError, match="keep entry 'nothing' matches no layer"):
        pa.MixedPrecision("mxfp8:keep=nothing", framework="tensorflow").watch(model)


# -- EinsumDense (MultiHeadAttention's projections) ------------------------------------------------------
# equation, x shape, kernel shape, K; x -> (free x axes, contracted) perm, kernel -> (contracted, free)
# perm, and the output's axes as a perm of (free x axes, free kernel axes); None: the identity
EINSUM_CASES = [
    ("abc,cde->abde", (2, 16, 64), (64, 4, 24), 64, None, None, None),  # MHA's query / key / value
    ("abcd,cde->abe", (2, 16, 4, 16), (4, 16, 96), 64, None, None, None),  # MHA's output
    ("bca,dc->abd", (16, 64, 2), (96, 64), 64, (0, 2, 1), (1, 0), (1, 0, 2)),  # transposes everywhere
    ("...c,cd->...d", (2, 16, 64), (64, 96), 64, None, None, None),
]
EINSUM_IDS = [c[0] for c in EINSUM_CASES]


def einsum_case(spec, case):
    """y, dx, dw of ``einsum_gemm`` of ``linear`` (fp32 products) on fixed operands, and the quantizer."""
    from polyamp.tensorflow.recipe_einsum import einsum_gemm, gemm_plan

    equation, xs, ws = case[:3]
    r = recipes.parse_recipe(spec)
    x, w = wide(xs, 3), wide(ws, 4) / 8
    q = tr.Quantizer(r)
    for operand in ("input", "weight", "grad") if r.kind == "delayed" else ():
        q.add("fc", operand)
    xt, wt = tf.constant(x), tf.Variable(w)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = einsum_gemm(gemm_plan(equation, len(xs)), tr.linear(q, "fc", tf.float32), xt, wt)
    g = wide(tuple(y.shape), 5)
    dx, dw = tape.gradient(y, [xt, wt], output_gradients=tf.constant(g))
    return r, (x, w, g), (y.numpy(), dx.numpy(), dw.numpy()), q


def test_an_einsum_dense_at_open_dimensions_traces_as_it_runs_eagerly():
    """A watched EinsumDense (MultiHeadAttention's query projection) in a step traced with the batch and
    sequence dimensions open, as fit traces a keras_hub model's, and eagerly: the same output and
    gradients, bit for bit (a float32 layer: eagerly, ``gemm_case``'s operands and kernels)."""
    mp = pa.MixedPrecision("mxfp8:keep=", framework="tensorflow")
    keras.utils.set_random_seed(0)
    with mp.scope():
        layer = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 24), bias_axes="de", dtype="float32",
                                         name="query")  # fmt: skip
        model = keras.Sequential([keras.Input((None, 64)), layer])
    mp.watch(model)
    assert mp.recipe_layers.quantized == ["query"]

    def run(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
        return (y, *tape.gradient(y, [x, *layer.trainable_variables], output_gradients=g))

    open_dims = [tf.TensorSpec([None, None, 64]), tf.TensorSpec([None, None, 4, 24])]
    x, g = tf.constant(wide((2, 16, 64), 3)), tf.constant(wide((2, 16, 4, 24), 5))
    traced, eager = tf.function(run, input_signature=open_dims)(x, g), run(x, g)
    assert [t.shape for t in traced] == [(2, 16, 4, 24), (2, 16, 64), (64, 4, 24), (4, 24)]
    assert all(same(a, b) for a, b in zip(traced, eager))


@pytest.mark.parametrize("case", EINSUM_CASES, ids=EINSUM_IDS)
def test_einsum_dense_plan_computes_keras_einsum(case):
    """With no GEMM quantized, the flattened GEMM is Keras's einsum and its gradients."""
    spec = "fp8-tensorwise:quantize_forward=false:quantize_input_grad=false:quantize_weight_grad=false"
    _, (x, w, g), (y, dx, dw), _ = einsum_case(spec, case)
    xt, wt = tf.constant(x), tf.constant(w)
    with tf.GradientTape() as tape:
        tape.watch([xt, wt])
        want = keras.ops.einsum(case[0], xt, wt)
    assert y.shape == tuple(want.shape)
    for got, ref in zip((y, dx, dw), [want, *tape.gradient(want, [xt, wt], output_gradients=tf.constant(g))]):
        ref = np.asarray(ref)
        assert got.shape == ref.shape and np.allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(("spec", "case"), [
    ("mxfp8", EINSUM_CASES[0]), ("fp8-tensorwise", EINSUM_CASES[0]), ("nvfp4:hadamard=true", EINSUM_CASES[1]),
    ("fp8-delayed", EINSUM_CASES[1]), ("mxfp8", EINSUM_CASES[2]), ("nvfp4", EINSUM_CASES[2]),
    ("fp8-tensorwise", EINSUM_CASES[3])], ids=lambda v: v if isinstance(v, str) else v[0])  # fmt: skip
def test_einsum_dense_gemms_are_the_quantized_gemms_of_the_core(spec, case):
    """EinsumDense's y, dx, dW are Dense's three quantized GEMMs on x2d (x's free axes by its contracted
    ones) and W2d (the contracted axes by the kernel's free ones), bit for bit, the core quantizing."""
    r, (x, w, g), (y, dx, dw), q = einsum_case(spec, case)
    _, _, _, k, x_perm, w_perm, out_perm = case
    x_t = x if x_perm is None else x.transpose(x_perm)
    w_t = w if w_perm is None else w.transpose(w_perm)
    x2, w2 = x_t.reshape(-1, k), w_t.reshape(k, -1)
    m, n = x2.shape[0], w2.shape[1]
    y2 = (y if out_perm is None else y.transpose(np.argsort(out_perm))).reshape(m, n)
    g2 = (g if out_perm is None else g.transpose(np.argsort(out_perm))).reshape(m, n)
    block, sr = r.kind == "block", r.grad_rounding == "stochastic"
    scale = 1.0 if r.kind == "delayed" else None

    def mm(a, b):
        return tf.linalg.matmul(*(tf.constant(np.asarray(t, np.float32)) for t in (a, b)))

    xq, wq = core(x2, r, "input", -1, scale=scale), core(w2, r, "weight", 0, scale=scale)
    assert same(y2, mm(xq, wq))
    g_dgrad = core(g2, r, "grad", -1, seed=1 if sr else None, scale=scale)
    w_dgrad = core(w2, r, "weight", 1) if block and not r.weight_2d else wq
    dx_t = mm(g_dgrad, w_dgrad.T).numpy().reshape(x_t.shape)
    assert same(dx, dx_t if x_perm is None else dx_t.transpose(np.argsort(x_perm)))
    x_w, g_w = (hadamard_tiles(x2, 0), hadamard_tiles(g2, 0)) if r.hadamard else (x2, g2)
    x_wgrad = core(x_w, r, "input", 0) if block else xq
    g_wgrad = core(g_w, r, "grad", 0, seed=2 if sr else None) if block else g_dgrad
    dw_t = mm(x_wgrad.T, g_wgrad).numpy().reshape(w_t.shape)
    assert same(dw, dw_t if w_perm is None else dw_t.transpose(np.argsort(w_perm)))
    assert int(q.calls.numpy()) == (2 if sr else 0)
