"""gradcomp.integrations.transformers with the real Hugging Face Trainer on 2 Gloo CPU processes: the
hook runs on the DDP model the Trainer builds, replicas stay identical, and a run resumed from a
Trainer checkpoint restores every rank's hook state (as exactly as the same resume without
gradcomp); a checkpoint from another world size, or without a rank's state, stops every rank with
one clear error. One launch (module fixture) runs every Trainer; the tests read its results."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

STEPS = 4  # a checkpoint at STEPS // 2 and at STEPS
METHODS = ("int8", "sign")


def _launcher_environment(rank, world):
    """What torchrun sets (the Trainer reads it); the process group already exists."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _data():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(64, (64, 16), generator=gen)
    return [{"input_ids": t, "labels": t} for t in tokens]


def _state(method, folder):
    from gradcomp.hooks import AutoState, hook_for

    hook, state_class = hook_for(method)
    if method == "auto":  # an evaluation at step 2 (costs measured once, cached in the run's folder)
        return AutoState(None, methods=METHODS, warmup_steps=2, evaluate_every=2,
                         cache=f"{folder}/costs.json"), hook
    return state_class(None), hook


def _train(folder, method=None, resume=None, restore=True):
    """A fresh Trainer (and hook state) trained to STEPS from scratch or from ``resume``; returns
    its flat parameters and its hook state (or None)."""
    from transformers import Trainer, TrainingArguments
    from gradcomp.integrations.transformers import attach

    args = TrainingArguments(output_dir=folder, use_cpu=True, ddp_backend="gloo", report_to=[],
                             per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
                             save_strategy="steps", save_steps=STEPS // 2, logging_strategy="no",
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)
    model = _model()
    trainer = Trainer(model=model, args=args, train_dataset=_data())
    state = None
    if method is not None:
        state, hook = _state(method, folder)
        attach(trainer, state, hook, restore=restore)
    trainer.train(resume_from_checkpoint=resume)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(), state


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def _runs(rank, world, root):
    _launcher_environment(rank, world)
    out = {}
    # without gradcomp: what resuming a Trainer checkpoint changes by itself
    out["plain"], _ = _train(f"{root}/plain")
    out["plain_resumed"], _ = _train(f"{root}/plain_resumed", resume=f"{root}/plain/checkpoint-{STEPS // 2}")
    for method in (*METHODS, "auto"):
        params, state = _train(f"{root}/{method}", method)
        out[method] = {"params": params, "step": state.step, "totals": dict(state.stats.totals),
                       "decisions": getattr(state.stats, "decisions", None), "options": dict(state.options)}
    # auto, given the Trainer's optimizer before it restores: its checkpoint's options are met
    _, state = _train(f"{root}/auto_resumed", "auto", resume=f"{root}/auto/checkpoint-{STEPS // 2}")
    out["auto_resumed"] = {"step": state.step, "options": dict(state.options)}
    half = f"{root}/int8/checkpoint-{STEPS // 2}"
    out["resumed"], state = _train(f"{root}/resumed", "int8", resume=half)
    out["resumed_step"] = state.step
    out["not_restored"], state = _train(f"{root}/not_restored", "int8", resume=half, restore=False)
    out["not_restored_step"] = state.step
    # resume=True: the newest checkpoint in output_dir, checkpoint-STEPS (5.24 trains one more step)
    out["latest_step"] = _train(f"{root}/int8", "int8", resume=True)[1].step

    # checkpoints the hook state must refuse: another world size's, one without rank 1's file
    wider, partial = f"{root}/wider", f"{root}/partial"
    if rank == 0:
        shutil.copytree(half, wider)
        shutil.copytree(half, partial)
        os.remove(f"{partial}/gradcomp_rank1.pt")
    dist.barrier()
    saved = torch.load(f"{wider}/gradcomp_rank{rank}.pt", weights_only=True)
    saved["world_size"] = 4  # as rank <rank> of a 4-rank run saved it
    torch.save(saved, f"{wider}/gradcomp_rank{rank}.pt")
    dist.barrier()
    out["wider_error"] = _raised(_train, f"{root}/x", "int8", resume=wider)
    out["partial_error"] = _raised(_train, f"{root}/y", "int8", resume=partial)
    out["files"] = sorted(os.listdir(half))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("trainer")), timeout_s=60)


@pytest.mark.parametrize("method", METHODS)
def test_the_hook_compresses_and_replicas_stay_identical(results, method):
    for rank in range(2):
        run = results[rank][method]
        assert run["step"] == STEPS
        raw, wire = run["totals"]["raw_bytes"], run["totals"]["wire_bytes"]
        assert 0 < wire < raw / 2, (rank, run["totals"])
        assert not torch.equal(run["params"], results[rank]["plain"])  # compressed: another path
    assert torch.equal(results[0][method]["params"], results[1][method]["params"])


def test_auto_evaluates_inside_the_trainer_and_replicas_stay_identical(results):
    """...given the Trainer's AdamW (built inside train(), after attach): its ratios in AdamW's
    update's coordinates, sign refused by the measured table; resumed from its checkpoint."""
    for rank in range(2):
        run = results[rank]["auto"]
        assert run["step"] == STEPS
        assert [d["step"] for d in run["decisions"]] == [2]  # warmup_steps=2, evaluate_every=2
        assert run["totals"]["raw_bytes"] > 0
        assert (run["options"]["coordinates"], run["options"]["optimizer_family"]) == ("update", "adamw")
        decision = run["decisions"][0]
        assert "sign" in decision["refused"] and all(set(q) == {"int8"} for q in decision["quality"].values())
        resumed = results[rank]["auto_resumed"]
        assert resumed["step"] == STEPS and resumed["options"] == run["options"]
    assert results[0]["auto"]["decisions"][0]["choices"] == results[1]["auto"]["decisions"][0]["choices"]
    assert torch.equal(results[0]["auto"]["params"], results[1]["auto"]["params"])


def test_every_rank_saves_its_state_into_the_checkpoint_folder(results):
    files = results[0]["files"]
    assert {"gradcomp_rank0.pt", "gradcomp_rank1.pt", "trainer_state.json"} <= set(files)


def test_a_resumed_run_equals_the_uninterrupted_one_as_without_gradcomp(results):
    for rank in range(2):
        r = results[rank]
        plain_gap = (r["plain_resumed"] - r["plain"]).abs().max().item()
        gap = (r["resumed"] - r["int8"]["params"]).abs().max().item()
        assert gap <= plain_gap, f"rank {rank}: resumed off by {gap}, without gradcomp {plain_gap}"
        # the state came back: its step counter, and residuals that change the result
        assert r["resumed_step"] == r["not_restored_step"] + STEPS // 2 == STEPS
        lost = (r["not_restored"] - r["int8"]["params"]).abs().max().item()
        assert lost > max(gap, plain_gap), f"rank {rank}: not restoring the residuals changed nothing"
        assert r["latest_step"] >= STEPS  # resume=True restored checkpoint-STEPS
    assert torch.equal(results[0]["resumed"], results[1]["resumed"])


def test_a_checkpoint_from_another_world_size_or_without_a_ranks_state_stops_every_rank(results):
    for rank in range(2):
        wider, partial = results[rank]["wider_error"], results[rank]["partial_error"]
        assert wider is not None and "world size 4" in wider and "rank 0" in wider and "rank 1" in wider
        assert partial is not None and "rank 1: no gradcomp_rank1.pt" in partial
        assert "rank 0:" not in partial  # rank 0 loaded its own, and still stopped


def test_a_callback_without_its_trainer_says_how_to_attach():
    from gradcomp.hooks import Int8State, int8_hook
    from gradcomp.integrations.transformers import CommHookCallback

    with pytest.raises(RuntimeError, match="attach"):
        CommHookCallback(Int8State(None), int8_hook).on_train_begin(None, None, None)


def test_the_state_follows_the_trainers_grad_scaler():
    """fp16 needs a GPU under Accelerate; the wiring, with a stand-in trainer: the hook goes on
    ``model_wrapped`` (under torch.compile's ``_orig_mod``), the state follows
    ``accelerator.scaler``."""
    from types import SimpleNamespace

    from gradcomp.hooks import Int8State, int8_hook
    from gradcomp.integrations.transformers import CommHookCallback

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            self.registered = (state, hook)

        def named_parameters(self):
            return iter(())

    ddp, scaler = FakeDDP(), torch.amp.GradScaler("cpu")
    trainer = SimpleNamespace(model_wrapped=SimpleNamespace(_orig_mod=ddp),
                              accelerator=SimpleNamespace(scaler=scaler),
                              callback_handler=SimpleNamespace(callbacks=[]), train=lambda *a, **k: None,
                              args=SimpleNamespace(output_dir="."))
    trainer.add_callback = trainer.callback_handler.callbacks.append
    state = Int8State(None)
    callback = CommHookCallback(state, int8_hook).attach(trainer)
    assert trainer.callback_handler.callbacks == [callback]
    callback.on_train_begin(None, None, None)
    assert ddp.registered == (state, int8_hook) and state._scaler is scaler
    with pytest.raises(RuntimeError, match="already attached"):
        CommHookCallback(Int8State(None), int8_hook).attach(trainer)
