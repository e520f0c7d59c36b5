"""polyamp in Hugging Face Accelerate (polyamp.accelerate.Accelerator) and the HF Trainer (polyamp.hf.Trainer)
on a tiny GPT-2, real libraries: fp16 on the CPU really scales, an injected overflow is skipped exactly as
a ``torch.amp.GradScaler`` loop skips it (same steps, same scale trajectory, same weights), the Trainer's
default ``max_grad_norm=1.0`` clips the unscaled gradients, a recipe trains through the Trainer, and the
Trainer's own checkpoint (its ``scaler.pt``) resumes bit for bit."""

import math

import pytest
from docs_example import run_example
from frameworks import require

torch = require("torch")
transformers = require("transformers")
accelerate = require("accelerate")

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.accelerate import Accelerator  # noqa: E402
from polyamp.hf import Trainer  # noqa: E402

VOCAB, SEQ = 64, 8
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning",
                                        "ignore::FutureWarning")  # fmt: skip


def gpt2(seed: int = 0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip


def batch(step: int) -> dict:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def grad_scaler_loop(steps: int, inject=(), clip: float | None = None):
    """The reference: torch.autocast fp16 and a torch.amp.GradScaler, by hand."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    scales = []
    for step in range(steps):
        with torch.autocast("cpu", torch.float16):
            loss = model(**batch(step)).loss
        scaler.scale(loss * math.inf if step in inject else loss).backward()
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return model, scales


# -- Accelerate ------------------------------------------------------------------------------------------
def test_accelerate_fp16_on_a_cpu_scales_and_skips_as_grad_scaler_does():
    torch_scale = pa.DynamicLossScale.preset("torch", growth_interval=2)
    accelerator = Accelerator("fp16-mixed", cpu=True, loss_scale=torch_scale)
    model = gpt2()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), 1e-3))
    scales, skipped = [], []
    for step in range(6):
        loss = model(**batch(step)).loss
        assert loss.dtype == torch.float32  # the forward ran under autocast; the loss is float32
        accelerator.backward(loss * math.inf if step in (1, 2) else loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        scales.append(accelerator.scaler.get_scale())
        skipped.append(accelerator.optimizer_step_was_skipped)
    reference, want = grad_scaler_loop(6, inject=(1, 2), clip=1.0)
    assert scales == want == [2.0**16, 2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15]
    assert skipped == [False, True, True, False, False, False]
    ours = accelerator.unwrap_model(model).parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, reference.parameters()))


def test_accelerate_refuses_its_own_mixed_precision_beside_polyamps():
    with pytest.raises(PolyampError, match="leave Accelerate's mixed_precision unset"):
        Accelerator("bf16-mixed", mixed_precision="fp16", cpu=True)
    native = accelerate.Accelerator(cpu=True)
    model = gpt2()
    native.prepare(torch.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(PolyampError, match="before accelerator.prepare"):
        pa.accelerate.attach(native, pa.MixedPrecision("fp16-mixed", framework="torch"))


# -- the HF Trainer --------------------------------------------------------------------------------------
def args(tmp_path, steps: int, **kwargs):
    options = {"output_dir": str(tmp_path), "max_steps": steps, "per_device_train_batch_size": 2,
               "learning_rate": 1e-3, "lr_scheduler_type": "constant", "weight_decay": 0.0,
               "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True, "seed": 0,
               "disable_tqdm": True}  # fmt: skip
    return transformers.TrainingArguments(**{**options, **kwargs})


SAME = {k: v[:1].repeat(2, 1) for k, v in batch(0).items()}  # the Trainer's every batch: two copies of a row


class Dataset(torch.utils.data.Dataset):
    """Every item the same sequence, so each batch is the same whatever order the sampler draws."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = SAME["input_ids"][0]
        return {"input_ids": ids, "labels": ids}


class Overflowing(Trainer):
    """The loss of the steps in ``inject`` made inf (a test's injected overflow)."""

    inject: tuple = ()

    def compute_loss(self, model, inputs, **kwargs):
        loss = super().compute_loss(model, inputs, **kwargs)
        return loss * math.inf if self.state.global_step in self.inject else loss


def train(tmp_path, precision, steps: int, inject=(), options=None, resume=None, **kwargs):
    trainer = Overflowing(model=gpt2(), args=args(tmp_path, steps, **kwargs), train_dataset=Dataset(),
                          precision=precision, precision_options=options)  # fmt: skip
    trainer.inject = tuple(inject)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_the_trainer_skips_an_injected_overflow_and_clips_unscaled_gradients(tmp_path):
    options = {"loss_scale": pa.DynamicLossScale.preset("torch", growth_interval=2), "device": "cpu"}
    trainer = train(tmp_path, "fp16-mixed", 6, inject=(1, 2), options=options)
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert trainer.mp.state.skipped == 2 and trainer.mp.current_scale == 2.0**15
    # max_grad_norm=1.0 (the default) saw unscaled gradients: the first norm is bf16's, not 2^16 times it
    bf16 = train(tmp_path, "bf16-mixed", 1)
    first_bf16 = next(h["grad_norm"] for h in bf16.state.log_history if "grad_norm" in h)
    assert logged[0]["grad_norm"] == pytest.approx(first_bf16, rel=0.05) and logged[0]["grad_norm"] < 1e3
    # the same skips and scales as the GradScaler loop on the same batches (each batch is SAME)
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), 1e-3, weight_decay=0.0, fused=True)  # the Trainer's default
    scaler, scales = torch.amp.GradScaler("cpu", growth_interval=2), []
    items = SAME["labels"].numel()  # the Trainer divides the summed token losses by its count of labels
    for step in range(6):
        with torch.autocast("cpu", torch.float16):
            loss = model(**SAME, num_items_in_batch=items).loss
        scaler.scale(loss * math.inf if step in (1, 2) else loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales[-1] == trainer.mp.current_scale
    assert all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), model.parameters()))


def test_a_recipe_trains_through_the_trainer(tmp_path):
    trainer = train(tmp_path, "mxfp8", 2)
    record = trainer.mp.recipe_layers
    assert len(record.quantized) == 7 and set(record.kept) == {"transformer.h.0.attn.c_attn", "lm_head"}
    assert trainer.mp.state_dict()["recipe"]["state"]["calls"] > 0


def test_the_trainers_checkpoint_resumes_bit_for_bit(tmp_path):
    options = {"loss_scale": pa.DynamicLossScale.preset("torch", growth_interval=2), "device": "cpu"}
    whole = train(tmp_path / "whole", "fp16-mixed", 4, inject=(1,), options=options)
    train(tmp_path / "half", "fp16-mixed", 4, inject=(1,), options=options, save_strategy="steps",
          save_steps=2)
    resumed = train(tmp_path / "half", "fp16-mixed", 4, inject=(1,), options=options,
                    resume=str(tmp_path / "half" / "checkpoint-2"))  # fmt: skip
    assert resumed.mp.current_scale == whole.mp.current_scale and resumed.mp.state.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))


def test_the_trainer_refuses_accelerates_fp16_beside_polyamp(tmp_path):
    with pytest.raises(PolyampError, match="leave fp16 and bf16 False"):
        Trainer(model=gpt2(), args=args(tmp_path, 1, bf16=True), train_dataset=Dataset(),
                precision="fp16-mixed")


def test_the_docs_example_runs(tmp_path):
    """docs/huggingface.md's example, run here: what it prints is what the page says."""
    run_example("huggingface.md", "torch", tmp_path)
