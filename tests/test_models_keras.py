"""Real keras_hub models under polyamp (tiny configs, no downloads): GPT2Backbone with a Dense LM head and
BertBackbone with a classifier: bf16-mixed under ``model.fit`` against Keras's own ``mixed_bfloat16`` (on
GPT2: the guard and the casts are the model's, not the architecture's), a recipe's record of the layers it
quantizes (counted from the model's own layers) and GPT2 training under it, checkpoint / resume in a new
process, and the doctor with rows named by layer path."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from frameworks import require

tf = require("tensorflow")
keras_hub = require("keras_hub")
import keras  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp.keras.keep import named_layers  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 100, 8, 4, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

GPT2_SOURCE = textwrap.dedent('''
    import keras, keras_hub

    def gpt2(vocab=100, seq=8):
        """GPT2Backbone (2 layers x 64, no dropout) with a Dense LM head."""
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=2, num_heads=2,
                                                 hidden_dim=64, intermediate_dim=128, dropout=0.0,
                                                 max_sequence_length=seq)
        inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
        return keras.Model(inputs, keras.layers.Dense(vocab, name="head")(backbone(inputs)))
''')
exec(GPT2_SOURCE)  # defines gpt2(): the child process of the resume test builds the same model


def bert():
    """BertBackbone (2 layers x 64, no dropout) with a Dense classifier on the pooled output."""
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2,
                                             hidden_dim=64, intermediate_dim=128, dropout=0.0,
                                             max_sequence_length=SEQ)  # fmt: skip
    names = ("token_ids", "segment_ids", "padding_mask")
    inputs = {n: keras.Input((None,), dtype="int32", name=n) for n in names}
    return keras.Model(inputs, keras.layers.Dense(2, name="classifier")(backbone(inputs)["pooled_output"]))


def data(model: str, n=BATCH * STEPS, seed=0):
    """numpy inputs and targets, as fit takes them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, SEQ + 1)).astype("int32")
    ones = np.ones((n, SEQ), "int32")
    if model == "gpt2":
        return {"token_ids": tokens[:, :-1], "padding_mask": ones}, tokens[:, 1:]
    x = {"token_ids": tokens[:, :-1], "segment_ids": np.zeros_like(ones), "padding_mask": ones}
    return x, tokens[:, 0] % 2


BUILD = {"gpt2": gpt2, "bert": bert}  # noqa: F821  (gpt2 is defined by the exec above)


def built(model: str, policy: str, weights=None, run_eagerly=False):
    """(model compiled for fit under ``policy``, its MixedPrecision or None); "native": Keras's
    ``mixed_bfloat16`` and a plain Adam. Same weights for every policy."""
    keras.utils.set_random_seed(0)
    if policy == "native":
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            net = BUILD[model]()
        finally:
            keras.config.set_dtype_policy("float32")
        mp, opt = None, keras.optimizers.Adam(1e-3)
    else:
        mp = pa.MixedPrecision(policy, framework="tensorflow")
        with mp.scope():
            net = BUILD[model]()
        if mp.recipe is not None:
            mp.watch(net)
        opt = mp.optimizer(keras.optimizers.Adam(1e-3))
    if weights is not None:
        net.set_weights(weights)
    net.compile(optimizer=opt, loss=LOSS, run_eagerly=run_eagerly)
    return net, mp


def fit(net, model: str):
    x, y = data(model)
    return net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history["loss"]


@pytest.fixture(scope="module")
def starts():
    """Per model: the initial weights (every policy starts from them)."""
    return {model: built(model, "native")[0].get_weights() for model in ("gpt2", "bert")}


@pytest.fixture(scope="module")
def bf16_run(starts):
    """GPT2 from its initial weights: Keras mixed_bfloat16's and polyamp bf16-mixed's fit losses and
    weights on the same data, and polyamp's trained model."""
    native, _ = built("gpt2", "native", starts["gpt2"])
    ours, _ = built("gpt2", "bf16-mixed", starts["gpt2"])
    return (fit(native, "gpt2"), native.get_weights()), (fit(ours, "gpt2"), ours.get_weights()), ours


def test_bf16_mixed_under_fit_equals_keras_mixed_bfloat16(bf16_run, starts):
    """Measured: bit-identical losses and weights after the steps (the same casts and bf16 kernels;
    polyamp's guard only checks the gradients)."""
    (want, native), (got, ours), _ = bf16_run
    assert got == want
    assert all(np.array_equal(a, b) for a, b in zip(ours, native))
    start = starts["gpt2"]
    assert sum(not np.array_equal(a, b) for a, b in zip(ours, start)) > len(start) // 2  # it trained


def matmul_layer_names(net) -> list[str]:
    types = (keras.layers.Dense, keras.layers.EinsumDense)
    return [n for n, layer in named_layers(net) if isinstance(layer, types)]


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_a_recipe_quantizes_every_matmul_layer_but_first_and_last(model, starts):
    """mxfp8's record, counted from the model's own layers; on GPT2 it trains under fit, away from
    bf16-mixed's fit. Both fits run eagerly (a traced one of the emulated GEMMs of 11 layers costs ~40 s; a
    traced step with EinsumDense at open dimensions is test_tensorflow_recipes.py's
    test_an_einsum_dense_at_open_dimensions_traces_as_it_runs_eagerly)."""
    start = starts[model]
    net, mp = built(model, "mxfp8", start, run_eagerly=True)
    names = matmul_layer_names(net)
    record = mp.recipe_layers
    assert record.quantized == names[1:-1]
    assert record.kept == {names[0]: "keep 'first'", names[-1]: "keep 'last'"}
    einsum = [n for n, layer in named_layers(net) if isinstance(layer, keras.layers.EinsumDense)]
    assert len(einsum) == 4 * 2 and set(einsum) - set(record.quantized) <= {names[0]}  # q/k/v/o of 2 blocks
    if model == "gpt2":
        assert np.isfinite(fit(net, model)).all()
        bf16, _ = built(model, "bf16-mixed", start, run_eagerly=True)
        fit(bf16, model)
        differ = [not np.array_equal(a, b) for a, b in zip(net.get_weights(), bf16.get_weights())]
        assert sum(differ) > len(differ) // 2


CHILD = GPT2_SOURCE + textwrap.dedent('''
    import sys
    import numpy as np
    import polyamp.tensorflow  # registers PolyampOptimizer for the .keras file
    net = keras.saving.load_model(sys.argv[1], compile=True)
    net.run_eagerly = True  # as the saving process goes on (no trace of the step in either)
    data = np.load(sys.argv[2])
    x = {"token_ids": data["token_ids"], "padding_mask": data["padding_mask"]}
    net.fit(x, data["y"], batch_size=int(sys.argv[4]), epochs=1, shuffle=False, verbose=0)
    np.savez(sys.argv[3], *net.get_weights())
''')


def test_a_fit_checkpoint_resumes_bit_for_bit_in_a_new_process(tmp_path, bf16_run):
    """The saved model goes on with fit here while a new process loads it and does the same."""
    net = bf16_run[2]  # polyamp bf16-mixed after its steps
    net.save(tmp_path / "ckpt.keras")
    x, y = data("gpt2", seed=1)
    np.savez(tmp_path / "batch.npz", y=y, **x)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    args = [tmp_path / "ckpt.keras", tmp_path / "batch.npz", tmp_path / "after.npz", BATCH]
    child = subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env)
    try:
        net.compile(optimizer=net.optimizer, loss=LOSS, run_eagerly=True)  # the same optimizer, its state
        fit_on = net.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        assert np.isfinite(fit_on.history["loss"]).all()
        assert child.wait(timeout=300) == 0
    finally:
        child.kill()
    resumed = np.load(tmp_path / "after.npz")
    assert all(np.array_equal(resumed[f"arr_{i}"], w) for i, w in enumerate(net.get_weights()))


def test_the_doctor_names_rows_by_layer_path_and_writes_its_report(tmp_path):
    keras.utils.set_random_seed(0)
    net = gpt2()  # noqa: F821
    x, y = data("gpt2", n=BATCH)
    net(x)
    report = pa.doctor(net, (x, y), LOSS, formats=("bf16", "recipe:mxfp8"))
    layers = {row.layer for row in report.rows}
    names = matmul_layer_names(net)
    assert set(names) <= layers and layers <= {n for n, _ in named_layers(net)}
    measured = {(row.layer, row.kind) for row in report.rows if "recipe:mxfp8" in row.measured}
    assert {n for n, k in measured if k != "output"} == set(names)  # the matmul layers' kernels and grads
    assert {k for _, k in measured} == {"weight", "grad_output", "output"}
    feeders = {n for n, k in measured if k == "output"}  # the layers whose outputs are a matmul's input
    assert any(n.endswith("/layer_norm") for n in feeders) and not any("embedding" in n for n, _ in measured)
    report.write(tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert {row["layer"] for row in saved["rows"]} == layers
