"""gradcomp.integrations with the real libraries on 2 Gloo CPU processes: Accelerate's save_state /
load_state and Lightning checkpoints restore every rank's own hook state, so that a resumed run
equals an uninterrupted one bit for bit."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_models import batch, build_model, flat_params
from dist_utils import run_ranks
from gradcomp.hooks import AutoState, Int8State, auto_hook, int8_hook

pytestmark = pytest.mark.slow

STEPS = 2


def _launcher_environment(rank, world):
    """What a launcher (accelerate launch, torchrun) sets; the process group already exists."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


# ---- Accelerate --------------------------------------------------------------------------------

def _accelerate(rank, world, folder):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from gradcomp.integrations.accelerate import checkpoint_hook_state

    _launcher_environment(rank, world)
    out = {}
    for phase in ("full", "first", "resume"):
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.004)])
        net = build_model()
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        state = Int8State(None, scheme="twophase", stochastic=True)
        model.register_comm_hook(state, int8_hook)
        checkpoint_hook_state(accelerator, state)
        start = 0
        if phase == "resume":
            accelerator.load_state(folder)
            start = STEPS
        for step in range(start, start + (2 * STEPS if phase == "full" else STEPS)):
            optimizer.zero_grad()
            x, y = batch(step, rank)
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
        if phase == "first":
            accelerator.save_state(folder)
        out[phase] = (flat_params(accelerator.unwrap_model(model)), state.step)
    out["auto_options"] = AutoState(None, optimizer=optimizer).options  # the prepared (wrapped) SGD
    return out


def test_accelerate_save_state_restores_every_ranks_hook_state(tmp_path):
    pytest.importorskip("accelerate")
    results = run_ranks(_accelerate, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("gradcomp_*")) == [
        "gradcomp_hook_state_rank0.pt", "gradcomp_hook_state_rank1.pt"]
    for rank in range(2):
        full, resumed = results[rank]["full"], results[rank]["resume"]
        assert not torch.equal(results[rank]["first"][0], full[0])
        assert resumed[1] == full[1] == 2 * STEPS
        assert torch.equal(resumed[0], full[0]), f"rank {rank}: resumed run differs"
        assert (results[rank]["auto_options"]["coordinates"], results[rank]["auto_options"]["optimizer_family"]) \
            == ("update", "sgd")
    assert torch.equal(results[0]["resume"][0], results[1]["resume"][0])


# ---- Lightning ---------------------------------------------------------------------------------

def _lightning(rank, world, folder):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.strategies import DDPStrategy
    from gradcomp.integrations.lightning import CommHookCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model()

        def training_step(self, data, index):
            x, y = data
            return F.cross_entropy(self.net(x[0]), y[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    _launcher_environment(rank, world)
    out = {}
    for phase, steps in (("full", 2 * STEPS), ("first", STEPS), ("resume", 2 * STEPS),
                         ("auto_first", STEPS), ("auto_resume", 2 * STEPS)):
        if phase.startswith("auto"):  # given the module's SGD when fitting starts, before the restore
            state, hook = AutoState(None, methods=("none", "int8"), warmup_steps=2, cache=f"{folder}/costs.json"), \
                auto_hook
        else:
            state, hook = Int8State(None, scheme="twophase", stochastic=True), int8_hook
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(bucket_cap_mb=0.004),
                             max_steps=steps, callbacks=[CommHookCallback(state, hook)], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False)
        module = Module()
        # one batch per epoch: Lightning 2.6 resumes a finished epoch by replaying its first batch
        loader = torch.utils.data.DataLoader([batch(0, rank)], batch_size=1)
        saved = f"{folder}/{phase.replace('resume', 'first')}.ckpt"
        trainer.fit(module, loader, ckpt_path=saved if phase.endswith("resume") else None)
        if phase.endswith("first"):
            trainer.save_checkpoint(saved)
        out[phase] = (flat_params(module.net), state.step, dict(state.options))
    dist.barrier()
    return out


def test_lightning_checkpoint_restores_every_ranks_hook_state(tmp_path):
    pytest.importorskip("pytorch_lightning")
    results = run_ranks(_lightning, 2, str(tmp_path))
    saved = torch.load(tmp_path / "first.ckpt", weights_only=False)
    ranks = next(v for k, v in saved["callbacks"].items() if "CommHookCallback" in k)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in range(2):
        full, resumed = results[rank]["full"], results[rank]["resume"]
        assert not torch.equal(results[rank]["first"][0], full[0])
        assert resumed[1] == full[1] == 2 * STEPS
        assert torch.equal(resumed[0], full[0]), f"rank {rank}: resumed run differs"
        # auto, given the module's SGD before Lightning's restore: its checkpoint's options are met
        first, resumed = results[rank]["auto_first"], results[rank]["auto_resume"]
        assert (first[2]["coordinates"], first[2]["optimizer_family"]) == ("update", "sgd")
        assert resumed[1] == 2 * STEPS and resumed[2] == first[2]


def test_each_integration_is_an_attribute_after_import_gradcomp_and_loads_its_framework_only_then():
    """The README writes gradcomp.integrations.transformers.attach(...) after ``import gradcomp``."""
    import subprocess
    import sys

    code = ("import sys, gradcomp; from gradcomp.integrations import MODULES; "
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules; "
            "print(gradcomp.integrations.transformers.attach.__name__, 'transformers' in sys.modules, "
            "all(hasattr(gradcomp.integrations, m) for m in MODULES))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["attach", "True", "True"]
    with pytest.raises(AttributeError, match="no attribute 'tensorflow'"):
        import gradcomp
        gradcomp.integrations.tensorflow
