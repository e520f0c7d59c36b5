"""Two-rank DDP (gloo, ``strategy="ddp_spawn"``) under polyamp's Lightning plugin, for
test_lightning.py: step 1's loss overflows on rank 0 only; each rank writes ``rank<N>.json`` into the
directory named by the first argument: the (stepped, scale) of each step (one file per rank: two ranks
printing at once interleave their lines)."""

import json
import sys
from pathlib import Path

import lightning as L
import torch

from polyamp import DynamicLossScale
from polyamp.lightning import Precision


class RankZeroOverflows(L.LightningModule):
    """A small MLP (no transformers import in the spawned ranks) whose rank 0 overflows at step 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, index):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        return loss * float("inf") if self.global_step == 1 and self.global_rank == 0 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


class Record(L.Callback):
    def __init__(self, out: str):
        self.steps, self.out = [], Path(out)

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        plugin = trainer.precision_plugin
        self.steps.append((plugin.last_step.stepped, plugin.mp.current_scale))

    def on_train_end(self, trainer, module):
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


if __name__ == "__main__":
    plugin = Precision("fp16-mixed", device="cpu", loss_scale=DynamicLossScale(init_scale=256.0))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=3,
                        callbacks=[Record(sys.argv[1])], plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(6)]
    trainer.fit(RankZeroOverflows(), torch.utils.data.DataLoader(data, batch_size=None))
