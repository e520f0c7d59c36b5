"""polyamp's Lightning plugins (polyamp.lightning) under real Lightning Trainer and Fabric runs on a tiny
Hugging Face GPT-2: fp16-mixed skips an injected overflow exactly as Lightning's own "16-mixed" plugin
with a torch.amp.GradScaler does (same steps skipped, same scale trajectory, same weights), bf16-mixed
equals Lightning's "bf16-mixed", a recipe trains through the Trainer, gradient accumulation and clipping
see the gradients a hand-written polyamp loop sees, a Lightning checkpoint resumes bit for bit, the loss
scale is logged. The scenarios of Lightning's own plugin tests are transcribed with real objects
(tests/tests_pytorch/plugins/precision/test_amp.py and tests/tests_fabric/plugins/precision/test_amp.py
in Lightning-AI/pytorch-lightning)."""


import pytest
from docs_example import run_example
from frameworks import require

torch = require("torch")
transformers = require("transformers")
L = require("lightning")

from lightning.pytorch.plugins import MixedPrecision as LightningMixedPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.lightning import FabricPrecision, Precision  # noqa: E402

VOCAB, SEQ, BATCH = 64, 8, 2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


def gpt2(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


def batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


class GPT2Module(L.LightningModule):
    """A GPT-2 language model; the loss of the training steps in ``inject`` is made inf (an overflow)."""

    def __init__(self, inject=(), seed: int = 0):
        super().__init__()
        self.model = gpt2(seed)
        self.inject = set(inject)

    def training_step(self, batch, index):
        loss = self.model(**batch).loss
        return loss * float("inf") if self.global_step in self.inject else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)


class Scales(L.Callback):
    """The loss scale after each optimizer step, read from either plugin."""

    def __init__(self):
        self.scales = []

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        plugin = trainer.precision_plugin
        if isinstance(plugin, Precision):
            self.scales.append(plugin.mp.current_scale)
        else:
            self.scales.append(plugin.scaler.get_scale() if plugin.scaler is not None else 1.0)


def fit(module, plugin, steps: int, **trainer_kwargs):
    scales = Scales()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], callbacks=[scales],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_kwargs)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches(steps * 2), batch_size=None))
    return trainer, scales.scales


def weights(module) -> list:
    return [p.detach().clone() for p in module.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- Trainer.fit ----------------------------------------------------------------------------------------
def test_fp16_skips_an_injected_overflow_as_lightnings_grad_scaler_does():
    """Steps 1 and 2 overflow: both plugins skip them, halve the scale twice, then grow it every 2 finite
    steps (growth_interval=2), and train to the same weights."""
    ours = GPT2Module(inject={1, 2})
    loss_scale = pa.DynamicLossScale.preset("torch", growth_interval=2)
    plugin = Precision("fp16-mixed", loss_scale=loss_scale, device="cpu")
    _, scales = fit(ours, plugin, 7)
    native = GPT2Module(inject={1, 2})
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    _, native_scales = fit(native, LightningMixedPrecision("16-mixed", "cpu", scaler=scaler), 7)
    assert scales == native_scales == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15, 2.0**16]
    assert plugin.skipped == 2 and plugin.mp.state.skipped == 2
    assert same(weights(ours), weights(native))


def test_bf16_mixed_equals_lightnings_bf16_mixed_and_logs_the_scale():
    ours = GPT2Module()
    trainer, _ = fit(ours, Precision("bf16-mixed"), 3)
    native = GPT2Module()
    fit(native, LightningMixedPrecision("bf16-mixed", "cpu"), 3)
    assert same(weights(ours), weights(native))
    assert trainer.precision == "bf16-mixed"
    logged = trainer.logged_metrics
    assert logged["polyamp/loss_scale"] == 1.0 and logged["polyamp/skipped"] == 0


class Rows(L.pytorch.loggers.Logger):
    """A Lightning logger that keeps the rows it is given."""

    def __init__(self):
        super().__init__()
        self.rows = []

    name, version = "rows", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {k: v for k, v in metrics.items() if k.startswith("polyamp/")}))

    def log_hyperparams(self, *args, **kwargs):
        pass


def test_the_loss_scale_reaches_the_logger_on_the_steps_it_writes():
    """log_every_n_steps=3 over 7 steps, overflows at steps 1 and 2: each row the logger writes holds
    the scale after that step and the skips so far (the plugin logs only on the steps that are written,
    the skipped ones and the last: ``self.log`` costs more than its step); the last step's values are the
    Trainer's ``callback_metrics`` at the end."""
    rows, scales = Rows(), Scales()
    plugin = Precision("fp16-mixed", device="cpu")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, plugins=[plugin], callbacks=[scales],
                        logger=rows, log_every_n_steps=3, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(GPT2Module(inject={1, 2}), torch.utils.data.DataLoader(batches(14), batch_size=None))
    written = [(step, m) for step, m in rows.rows if m]
    assert [step for step, _ in written] == [2, 5]  # steps 3 and 6 (1-based)
    skipped = [0, 1, 2, 2, 2, 2, 2]
    for step, metrics in written:
        assert metrics == {"polyamp/loss_scale": scales.scales[step], "polyamp/skipped": float(skipped[step])}
    assert trainer.callback_metrics["polyamp/loss_scale"] == scales.scales[-1] and scales.scales[2] == 2.0**14


def test_a_recipe_trains_through_the_trainer():
    module = GPT2Module()
    plugin = Precision("mxfp8", device="cpu")
    fit(module, plugin, 2)
    record = plugin.mp.recipe_layers
    assert len(record.quantized) == 7
    assert set(record.kept) == {"model.transformer.h.0.attn.c_attn", "model.lm_head"}
    assert plugin.mp.state_dict()["recipe"]["state"]["calls"] > 0
    bf16 = GPT2Module()
    fit(bf16, Precision("bf16-mixed"), 2)
    assert not same(weights(module), weights(bf16))  # the recipe's GEMMs changed the training


def hand_loop(steps: int, accumulate: int = 1, clip: float | None = None):
    """The polyamp loop a user writes by hand, for the Trainer's gradient accumulation and clipping."""
    module = GPT2Module()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
    mp.watch(module)
    opt = torch.optim.AdamW(module.parameters(), 1e-3)
    data = batches(steps * accumulate)
    for step in range(steps):
        for micro in data[step * accumulate:(step + 1) * accumulate]:
            with mp.autocast():
                loss = module.model(**micro).loss
            mp.backward(loss / accumulate)
        mp.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        mp.step(opt)
        opt.zero_grad()
    return weights(module), mp.current_scale


def test_gradient_accumulation_and_clipping_see_the_unscaled_gradients():
    module = GPT2Module()
    plugin = Precision("fp16-mixed", device="cpu")
    scales = Scales()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, plugins=[plugin], callbacks=[scales],
                        accumulate_grad_batches=2, gradient_clip_val=0.05, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches(4), batch_size=None))
    want, scale = hand_loop(2, accumulate=2, clip=0.05)
    assert same(weights(module), want) and plugin.mp.current_scale == scale == 2.0**16


def test_a_lightning_checkpoint_resumes_bit_for_bit(tmp_path):
    """Saved at an epoch's end (2 batches an epoch, so the resumed epoch sees the batches the whole run
    saw), a recipe's state, the loss scale and its skip count travel in Lightning's checkpoint."""
    data = torch.utils.data.DataLoader(batches(2), batch_size=None)
    quiet = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
             "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip
    whole = GPT2Module(inject={1})
    L.Trainer(max_epochs=2, plugins=[Precision("fp8-delayed", device="cpu")], **quiet).fit(whole, data)
    first = GPT2Module(inject={1})
    trainer = L.Trainer(max_epochs=1, plugins=[Precision("fp8-delayed", device="cpu")], **quiet)
    trainer.fit(first, data)
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed = GPT2Module(inject={1}, seed=9)  # other initial weights: the checkpoint's must win
    plugin = Precision("fp8-delayed", device="cpu")
    L.Trainer(max_epochs=2, plugins=[plugin], **quiet).fit(resumed, data, ckpt_path=tmp_path / "half.ckpt")
    assert same(weights(resumed), weights(whole))
    assert plugin.mp.state.skipped == 1 and plugin.mp.current_scale == 1.0  # fp8-delayed: no loss scale
    assert plugin.mp.state_dict()["recipe"]["state"]["calls"] > 0


def test_bad_input_is_refused():
    with pytest.raises(PolyampError, match="unknown policy|policy"):
        Precision("fp17-mixed")
    mp = pa.MixedPrecision("bf16-mixed", framework="torch")
    assert Precision(mp).mp is mp
    with pytest.raises(PolyampError, match="not both"):
        Precision(mp, loss_scale="none")
    module = GPT2Module()
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.parameters())
    with pytest.raises(PolyampError, match="L-BFGS"):
        fit(module, Precision("bf16-mixed"), 1)


# -- Lightning's own plugin scenarios (tests_pytorch/plugins/precision/test_amp.py), with real objects -----
def grads_of_a_linear(plugin):
    layer = torch.nn.Linear(4, 3)
    with plugin.forward_context():
        loss = layer(torch.full((2, 4), 10.0)).sum()
    loss.backward()
    return layer, torch.optim.SGD(layer.parameters(), 0.1)


@pytest.mark.parametrize("algorithm", [None, GradClipAlgorithmType.VALUE, GradClipAlgorithmType.NORM])
def test_clip_gradients_is_a_no_op_when_disabled_and_dispatches_by_algorithm(algorithm):
    """Lightning: test_clip_gradients."""
    plugin = Precision("bf16-mixed")
    layer, opt = grads_of_a_linear(plugin)
    before = [p.grad.clone() for p in layer.parameters()]
    if algorithm is None:
        plugin.clip_gradients(opt)
        assert same([p.grad for p in layer.parameters()], before)
        return
    plugin.clip_gradients(opt, clip_val=1.0, gradient_clip_algorithm=algorithm)
    grads = [p.grad for p in layer.parameters()]
    if algorithm == GradClipAlgorithmType.VALUE:
        assert all(g.abs().max() <= 1.0 for g in grads) and any(b.abs().max() > 1.0 for b in before)
    else:
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        assert float(norm) == pytest.approx(1.0, 1e-5)


def test_an_optimizer_that_unscales_in_its_step_can_be_clipped():
    """Lightning: test_optimizer_amp_scaling_support_in_step_method raises for a fused Adam; polyamp
    unscales before the optimizer runs, so clipping it is correct and allowed."""
    module = GPT2Module()
    module.configure_optimizers = lambda: torch.optim.Adam(module.parameters(), 1e-3, fused=True)
    plugin = Precision("fp16-mixed", device="cpu")
    assert module.configure_optimizers()._step_supports_amp_scaling
    fit(module, plugin, 1, gradient_clip_val=0.5)
    assert plugin.last_step.stepped and plugin.mp.current_scale == 2.0**16


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_a_no_grad_forward_inside_the_forward_context_keeps_gradient_tracking(grad_mode):
    """Lightning: test_amp_with_no_grad, test_amp_with_inference_mode."""
    layer, x = torch.nn.Linear(2, 1), torch.randn(1, 2)
    with Precision("bf16-mixed").forward_context():
        with grad_mode():
            layer(x)
        loss = layer(x).mean()
        loss.backward()
    assert loss.grad_fn is not None and layer.weight.grad is not None


# -- Fabric (tests_fabric/plugins/precision/test_amp.py) --------------------------------------------------
def test_fabric_bf16_has_no_loss_scale_and_autocasts_on_the_cpu():
    """Lightning: test_amp_precision_scaler_with_bf16, test_amp_precision_forward_context."""
    plugin = FabricPrecision("bf16-mixed")
    assert plugin.mp.current_scale == 1.0 and plugin.precision == "bf16-mixed"
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert FabricPrecision("fp16-mixed", device="cpu").mp.current_scale == 2.0**16


def test_fabric_backward_scales_the_loss_and_passes_its_arguments():
    """Lightning: test_amp_precision_backward (backward's arguments reach tensor.backward)."""
    plugin = FabricPrecision("fp16-mixed", device="cpu")
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    plugin.backward(loss, None, retain_graph=True)
    plugin.backward(loss, None)  # the graph was kept by retain_graph=True
    assert torch.equal(w.grad, torch.full((3,), 4.0 * 2**16))


def test_fabric_trains_skips_and_clips_through_fabric():
    """Lightning: test_amp_precision_optimizer_step_with_scaler / _without_scaler, through a real Fabric."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FabricPrecision("fp16-mixed", device="cpu")])
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    model, opt = fabric.setup(model, opt)
    plugin = fabric._precision
    results = []
    for step, batch in enumerate(batches(3)):
        loss = model(**batch).loss
        fabric.backward(loss * float("inf") if step == 1 else loss)
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)  # unscaled first
        opt.step()
        opt.zero_grad()
        results.append(plugin.last_step.stepped)
    assert results == [True, False, True] and plugin.mp.current_scale == 2.0**15
    with pytest.raises(PolyampError, match="takes no step arguments"):
        plugin.optimizer_step(opt, closure=None)


def test_ddp_ranks_skip_the_same_step_and_keep_one_scale(tmp_path):
    """DDP on gloo (two processes): an overflow on rank 0 alone is skipped by both ranks."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "lightning_ddp_worker.py")
    out = subprocess.run([sys.executable, worker, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    want = [[True, 256.0], [False, 128.0], [True, 128.0]]
    assert ranks == {0: want, 1: want}


def test_the_docs_example_runs(tmp_path):
    """docs/lightning.md's example, run here: what it prints is what the page says."""
    run_example("lightning.md", "torch", tmp_path)


# -- tests_pytorch/plugins/precision/test_amp_integration.py, on the CPU ------------------------------------
def test_a_skipped_training_step_skips_the_unscale_and_the_step():
    """Lightning: test_skip_training_step_with_grad_scaler (a training step returning None)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Skipping(BoringModel):
        def training_step(self, batch, batch_idx):
            return None if batch_idx % 2 else super().training_step(batch, batch_idx)

    plugin = Precision("fp16-mixed", device="cpu")
    trainer = L.Trainer(accelerator="cpu", max_steps=5, gradient_clip_val=0.5, plugins=[plugin],
                        barebones=True)  # fmt: skip
    trainer.fit(Skipping())
    assert plugin.mp.state.steps == 3  # batches 0, 2 and 4 unscaled, checked and stepped (or skipped)


def test_fused_and_plain_adam_train_alike():
    """Lightning: test_amp_fused_optimizer_parity (there on CUDA with a GradScaler; here on the CPU)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    def run(fused: bool):
        L.seed_everything(1234)
        model = BoringModel()
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=1.0, fused=fused)
        trainer = L.Trainer(accelerator="cpu", max_steps=5, plugins=[Precision("fp16-mixed", device="cpu")],
                            barebones=True)  # fmt: skip
        trainer.fit(model)
        return list(model.parameters())

    for p, q in zip(run(False), run(True)):
        torch.testing.assert_close(p, q)
