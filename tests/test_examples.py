"""examples/: data loaders on fixtures, models, config names, and the experiment runner end to end
(a tiny 2-rank sweep, its report, and exact resume from a checkpoint)."""
from __future__ import annotations

import ast
import csv
import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples import data, experiment, models  # noqa: E402
from gradcomp.analysis.auto import DEFAULT_POLICY, DEFAULT_QUALITY_BUDGET, OPT_IN, UPDATE_QUALITY_BUDGET  # noqa: E402

# ----------------------------------------------------------------------------- data


def write_cifar_batch(path: Path, images: np.ndarray, labels: list[int]) -> None:
    """A CIFAR-10 python batch: a pickled dict, bytes keys, data uint8 [N, 3072] (R, G, B planes)."""
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"fixture", b"labels": labels, b"data": images,
                     b"filenames": [b"x.png"] * len(labels)}, f, protocol=2)


@pytest.fixture
def cifar_folder(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batches = {}
    for name, n in (("data_batch_1", 5), ("data_batch_2", 3), ("test_batch", 4)):
        images = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        write_cifar_batch(folder / name, images, labels)
        batches[name] = (images, labels)
    return tmp_path, batches


def test_cifar_loader_reads_python_batches(cifar_folder):
    root, batches = cifar_folder
    loaded = data.load_cifar10(root)  # finds the cifar-10-batches-py subfolder
    train_images = np.concatenate([batches["data_batch_1"][0], batches["data_batch_2"][0]])
    assert loaded.train_x.shape == (8, 3, 32, 32) and loaded.test_x.shape == (4, 3, 32, 32)
    assert loaded.train_y.tolist() == batches["data_batch_1"][1] + batches["data_batch_2"][1]
    assert loaded.test_y.tolist() == batches["test_batch"][1]
    # pixel (row 5, col 7) of image 6: R, G, B at offsets 0, 1024, 2048 of the row-major planes
    raw = train_images[6, [5 * 32 + 7, 1024 + 5 * 32 + 7, 2048 + 5 * 32 + 7]] / 255.0
    expected = (raw - np.array(data.CIFAR_MEAN)) / np.array(data.CIFAR_STD)
    np.testing.assert_allclose(loaded.train_x[6, :, 5, 7].numpy(), expected, rtol=1e-5)
    assert loaded.augment == "crop-flip"


def test_cifar_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 python batches"):
        data.load_cifar10(tmp_path)
    write_cifar_batch(tmp_path / "data_batch_1", np.zeros((2, 100), np.uint8), [0, 1])
    write_cifar_batch(tmp_path / "test_batch", np.zeros((2, 3072), np.uint8), [0, 1])
    with pytest.raises(ValueError, match=r"expected data uint8 \[N, 3072\]"):
        data.load_cifar10(tmp_path)


def test_digits_loader_shapes_labels_and_split():
    from sklearn.datasets import load_digits

    digits = data.load_digits(side=16)
    assert digits.train_x.shape[1:] == (1, 16, 16) and digits.test_x.shape[1:] == (1, 16, 16)
    assert len(digits.train_y) + len(digits.test_y) == 1797 and len(digits.test_y) == 359
    all_labels = torch.cat([digits.train_y, digits.test_y])
    assert torch.equal(torch.bincount(all_labels), torch.bincount(torch.from_numpy(load_digits().target)))
    assert abs(float(digits.train_x.mean())) < 1e-4 and abs(float(digits.train_x.std()) - 1) < 1e-3
    other_split = data.load_digits(side=16, split_seed=1)
    assert not torch.equal(other_split.test_y, digits.test_y)
    with pytest.raises(ValueError, match="side must be >= 8"):
        data.load_digits(side=4)


def test_distorted_digits_hold_out_fixed_distortions_and_train_on_fresh_ones():
    plain, distorted = data.load_digits(side=16), data.load_digits(side=16, distort_copies=2)
    assert torch.equal(distorted.train_x, plain.train_x) and distorted.augment == "distort"
    assert torch.equal(distorted.test_y, plain.test_y.repeat(2)) and len(distorted.test_x) == 2 * 359
    assert torch.equal(distorted.test_x, data.load_digits(side=16, distort_copies=2).test_x)  # fixed
    first, second = distorted.test_x[:359], distorted.test_x[359:]
    assert not torch.equal(first, plain.test_x) and not torch.equal(first, second)
    x, y = data.image_batch(distorted, seed=0, epoch=0, step_in_epoch=0, rank=0, world_size=2, batch_size=8)
    px, py = data.image_batch(plain, seed=0, epoch=0, step_in_epoch=0, rank=0, world_size=2, batch_size=8)
    assert torch.equal(y, py) and not torch.equal(x, px)
    assert torch.equal(x, data.image_batch(distorted, 0, 0, 0, 0, 2, 8)[0])  # a pure function of the step
    with pytest.raises(ValueError, match="distort_copies must be >= 0"):
        data.load_digits(distort_copies=-1)


def test_distort_without_range_is_the_identity_and_fills_with_the_background():
    images = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    same = data.distort(images, torch.Generator().manual_seed(1), background=-0.5, degrees=0, scale=0, shift=0)
    torch.testing.assert_close(same, images, atol=1e-5, rtol=0)
    blank = torch.full((4, 1, 16, 16), -0.5)
    moved = data.distort(blank, torch.Generator().manual_seed(1), background=-0.5)
    torch.testing.assert_close(moved, blank, atol=1e-6, rtol=0)


def test_stdlib_corpus_is_deterministic_and_ordered():
    files = data.stdlib_python_files()
    assert files and not any("site-packages" in p.parts for p in files)
    corpus = data.stdlib_corpus(300_000)
    assert len(corpus) == 300_000 and corpus == data.stdlib_corpus(300_000)
    first = files[0].read_bytes()
    assert corpus.startswith(first[:300_000])
    assert data.stdlib_corpus(1000) == corpus[:1000]


def test_text_split_batches_and_heldout(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = data.read_text(path, max_bytes=5000)
    assert corpus == path.read_bytes()[:5000]
    text = data.split_text(corpus, context=16, heldout_fraction=0.1)
    assert len(text.train) == 4500 and len(text.heldout) == 500
    x, y = data.text_batch(text.train, 16, 8, data.batch_generator(3, 7, 1))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((x[:, 0] + 1) % 256, x[:, 1])  # a window of the corpus (bytes count up)
    x_again, _ = data.text_batch(text.train, 16, 8, data.batch_generator(3, 7, 1))
    x_other, _ = data.text_batch(text.train, 16, 8, data.batch_generator(3, 7, 2))
    assert torch.equal(x, x_again) and not torch.equal(x, x_other)
    hx, hy = data.heldout_windows(text.heldout, 16, 5)
    assert hx.shape == (5, 16) and int(hx[0, 0]) == int(text.heldout[0])
    with pytest.raises(ValueError, match="too small"):
        data.split_text(corpus[:100], context=16)
    with pytest.raises(FileNotFoundError):
        data.read_text(tmp_path / "missing.txt")


@settings(max_examples=25, deadline=None)
@given(n=st.integers(8, 60), world=st.integers(1, 4), batch=st.integers(1, 5), epoch=st.integers(0, 3))
def test_image_batches_partition_each_epoch(n, world, batch, epoch):
    """Across ranks and steps of one epoch, every example appears at most once (a sampler)."""
    assume(n >= world * batch)  # a rank's batch needs that many examples
    ids = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    images = data.ImageData(ids, torch.arange(n), ids[:1], torch.zeros(1, dtype=torch.long), 10, augment="none")
    seen = []
    for step in range(data.steps_per_epoch(n, batch, world)):
        for rank in range(world):
            x, y = data.image_batch(images, seed=1, epoch=epoch, step_in_epoch=step, rank=rank,
                                    world_size=world, batch_size=batch)
            assert torch.equal(x.flatten().long(), y) and len(y) == batch
            seen += y.tolist()
    assert len(seen) == len(set(seen)) == (n // (batch * world)) * batch * world


def test_crop_and_flip_keeps_shape_and_content():
    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8) + 1
    out = data.crop_and_flip(images, torch.Generator().manual_seed(0), pad=2)
    assert out.shape == images.shape
    for i in range(2):  # every non-zero output pixel is a pixel of the same image
        assert set(out[i][out[i] != 0].tolist()) <= set(images[i].flatten().tolist())


# ----------------------------------------------------------------------------- models


def test_model_shapes_and_parameter_counts():
    assert models.count_parameters(models.resnet20()) == 272_474
    assert models.count_parameters(models.resnet18()) == 11_173_962
    assert models.resnet20(in_channels=1)(torch.randn(3, 1, 16, 16)).shape == (3, 10)
    gpt = models.GPT()
    assert models.count_parameters(gpt) == 875_264
    assert gpt(torch.randint(0, 256, (2, 128))).shape == (2, 128, 256)
    with pytest.raises(ValueError, match="time <= 128"):
        gpt(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible"):
        models.GPTConfig(d_model=30, n_head=4)


def test_gpt_is_causal():
    gpt = models.GPT(models.GPTConfig(context=12, n_layer=2, d_model=32)).eval()
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 256
    with torch.no_grad():
        a, b = gpt(tokens), gpt(changed)
    assert torch.equal(a[0, :7], b[0, :7]) and not torch.equal(a[0, 7:], b[0, 7:])


# ----------------------------------------------------------------------------- runner


@pytest.mark.parametrize("name", experiment.SWEEP_CONFIGS + ("powersgd-r8-noef", "topk-0.5pct", "auto",
                                                            "auto-speed", "auto-q0.05", "auto-upd", "auto-upd-q0.05"))
def test_config_names_round_trip(name):
    args = experiment.build_parser().parse_args(["run", "--model", "gpt", "--out", "x",
                                                 *experiment.parse_config(name)])
    assert experiment.config_name(args.hook, args.error_feedback, args.rank, args.ratio,
                                  args.quality_budget, args.quality_coordinates) == name
    if args.hook == "auto":  # every candidate, the budget, and the optimizer's family reach the hook
        args = experiment.resolve_defaults(args)
        budget = {"auto": DEFAULT_QUALITY_BUDGET, "auto-speed": None, "auto-upd": UPDATE_QUALITY_BUDGET}.get(name, 0.05)
        assert args.config == name and experiment.hook_options(args) == {
            "methods": experiment.AUTO_METHODS, "optimizer_family": "adamw", "quality_budget": budget}
        # every method the auto hook takes is a candidate: its default policy and every opt-in one
        assert set(experiment.AUTO_METHODS) == set(DEFAULT_POLICY) | set(OPT_IN)


@pytest.mark.parametrize("bad", ["powersgd", "topk", "fp16-noef", "none-r2", "zip", "sign-r2", "auto-q", "auto-fast",
                                 "auto-upd-speed", "auto-speed-q0.1"])
def test_bad_config_names(bad):
    with pytest.raises(ValueError, match="bad configuration"):
        experiment.parse_config(bad)


def test_bad_run_arguments(tmp_path):
    parser = experiment.build_parser()
    for argv, message in ((["--steps", "0"], "--steps must be >= 1"),
                          (["--hook", "topk", "--ratio", "2"], "--ratio must lie in"),
                          (["--steps", "5", "--epochs", "2"], "not both"),
                          (["--link-gbps", "0"], "--link-gbps must be a rate > 0"),
                          (["--digits-distort", "-1"], "--digits-distort must be >= 0"),
                          (["--warmup-method", "int8"], "--warmup-method applies to --optimizer zeroone, not sgd"),
                          (["--optimizer", "dgc", "--outer-lr", "0.5"], "--outer-lr applies to --optimizer diloco"),
                          (["--optimizer", "adamw", "--density", "0.01"], "--density applies to --optimizer dgc"),
                          (["--hook", "int8", "--rank", "4"], "--rank applies to --hook powersgd, not int8"),
                          (["--no-ef"], "--no-ef applies to --hook int8 or int4"),
                          (["--hook", "int8", "--quality-coordinates", "update"],
                           "--quality-coordinates applies to --hook auto, not int8"),
                          (["--digits-distort", "2", "--cifar", str(tmp_path)], "--digits-distort applies to")):
        args = parser.parse_args(["run", "--model", "resnet20", "--out", str(tmp_path), *argv])
        with pytest.raises(ValueError, match=message):
            experiment.run(args)


def test_an_abbreviated_flag_is_refused_not_read_as_another(capsys):
    """``--warmup 0.1`` once ran as ``--warmup-method 0.1`` (argparse's prefix matching), which an
    SGD run ignores: every parser of the project refuses abbreviations."""
    with pytest.raises(SystemExit):
        experiment.build_parser().parse_args(["run", "--model", "resnet20", "--out", "x", "--warmup", "0.1"])
    assert "unrecognized arguments: --warmup 0.1" in capsys.readouterr().err
    calls = []
    for path in (p for d in ("gradcomp", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name in ("ArgumentParser", "_Parser", "add_parser"):
                    refused = any(k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False
                                  for k in node.keywords)
                    calls.append((f"{path.name}:{node.lineno}", refused))
    assert len(calls) >= 20 and [where for where, refused in calls if not refused] == []


def test_optimizer_defaults_follow_the_optimizer():
    parser = experiment.build_parser()

    def resolved(*argv):
        return experiment.resolve_defaults(parser.parse_args(["run", "--out", "x", *argv]))

    gpt = resolved("--model", "gpt")
    assert (gpt.optimizer, gpt.lr, gpt.weight_decay) == ("adamw", 2e-3, 0.1)
    gpt_sgd = resolved("--model", "gpt", "--optimizer", "sgd")
    assert (gpt_sgd.optimizer, gpt_sgd.lr, gpt_sgd.weight_decay) == ("sgd", 0.1, 5e-4)
    resnet = resolved("--model", "resnet20", "--optimizer", "adamw", "--lr", "0.01")
    assert (resnet.optimizer, resnet.lr, resnet.weight_decay) == ("adamw", 0.01, 0.1)


TINY_RESNET = ["--world-size", "2", "--steps", "6", "--eval-every", "3", "--batch-size", "8",
               "--digits-side", "8", "--quiet"]


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    experiment.main(["sweep", "--model", "resnet20", "--configs", "none", "topk-1pct", "--seeds", "3",
                     "--out", str(out), *TINY_RESNET])
    return out


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_tiny_run_writes_metrics(tiny_sweep):
    run_dir = tiny_sweep / "resnet20" / "topk-1pct" / "seed3"
    steps, evals = read_rows(run_dir / "steps.csv"), read_rows(run_dir / "evals.csv")
    assert [int(r["step"]) for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [int(r["step"]) for r in evals] == [3, 6]
    wire = [float(r["wire_bytes"]) for r in steps]
    assert all(b > a for a, b in zip(wire, wire[1:]))  # bytes accumulate every step
    assert all(0 < float(r["loss"]) < 10 for r in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["seed"] == 3 and summary["config"] == "topk-1pct"
    assert summary["wire_bytes"] == wire[-1] and summary["compression_ratio"] > 2
    assert 0 <= summary["final_heldout_accuracy"] <= 1
    assert (run_dir / "checkpoint" / "rank0.pt").is_file() and (run_dir / "checkpoint" / "rank1.pt").is_file()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["hook"] == "topk" and config["ratio"] == 0.01 and config["world_size"] == 2
    sweeps = json.loads((tiny_sweep / "resnet20" / "sweeps.json").read_text())
    assert [r["config"] for r in sweeps[0]["runs"]] == ["none", "topk-1pct"]


@pytest.mark.slow
def test_report_on_tiny_sweep(tiny_sweep):
    text = experiment.report(tiny_sweep)
    assert "topk-1pct" in text and "none" in text
    rows = {r["config"]: r for r in json.loads((tiny_sweep / "report.json").read_text())}
    baseline = json.loads((tiny_sweep / "resnet20" / "none" / "seed3" / "summary.json").read_text())
    compressed = json.loads((tiny_sweep / "resnet20" / "topk-1pct" / "seed3" / "summary.json").read_text())
    assert rows["none"]["diff_vs_none"] == 0
    assert rows["none"]["compression_ratio"] == pytest.approx(1.0)
    assert rows["topk-1pct"]["final"] == pytest.approx(100 * compressed["final_heldout_accuracy"])
    assert rows["topk-1pct"]["diff_vs_none"] == pytest.approx(
        100 * (compressed["final_heldout_accuracy"] - baseline["final_heldout_accuracy"]))
    assert rows["topk-1pct"]["wire_MB_per_rank"] < rows["none"]["wire_MB_per_rank"]
    assert (tiny_sweep / "resnet20_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(read_rows(tiny_sweep / "report.csv")) == 2
    assert experiment.report(tiny_sweep) == text  # its own outputs are not read back as runs


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """2N steps in one go == N steps, checkpoint, resume for N more: same losses and parameters
    (PowerSGD with error feedback: the residuals and warm-start Q come back from the checkpoint)."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(data.stdlib_corpus(60_000))
    common = ["run", "--model", "gpt", "--text", str(text), "--n-layer", "1", "--d-model", "32",
              "--context", "16", "--batch-size", "4", "--world-size", "2", "--steps", "8",
              "--eval-every", "4", "--eval-windows", "8", "--quiet", "--hook", "powersgd", "--rank", "1"]
    experiment.main([*common, "--out", str(tmp_path / "straight")])
    experiment.main([*common, "--out", str(tmp_path / "resumed"), "--stop-after", "4"])
    assert len(read_rows(tmp_path / "resumed" / "steps.csv")) == 4
    assert not (tmp_path / "resumed" / "summary.json").exists()
    experiment.main([*common, "--out", str(tmp_path / "resumed"), "--resume"])
    straight, resumed = (read_rows(tmp_path / d / "steps.csv") for d in ("straight", "resumed"))
    assert [r["loss"] for r in straight] == [r["loss"] for r in resumed]
    assert [r["wire_bytes"] for r in straight] == [r["wire_bytes"] for r in resumed]
    assert read_rows(tmp_path / "straight" / "evals.csv") == read_rows(tmp_path / "resumed" / "evals.csv")
    for rank in (0, 1):
        a, b = (torch.load(tmp_path / d / "checkpoint" / f"rank{rank}.pt", weights_only=False)
                for d in ("straight", "resumed"))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["step"] == b["step"] == 8
    with pytest.raises(ValueError, match="different settings"):
        experiment.main([*common, "--out", str(tmp_path / "resumed"), "--resume", "--lr", "0.5"])


@pytest.mark.slow
def test_a_run_over_an_emulated_link_trains_the_same_slower(tmp_path):
    """--link-gbps: the same losses, and the steps together at least as long as one rank's bytes
    beyond tbf's burst take at the rate (on the host's loopback a small fraction of that)."""
    from gradcomp.emulate import unavailable_reason
    if unavailable_reason():
        pytest.skip(unavailable_reason())
    text = tmp_path / "corpus.txt"
    text.write_bytes(data.stdlib_corpus(60_000))
    common = ["run", "--model", "gpt", "--text", str(text), "--n-layer", "1", "--d-model", "32",
              "--context", "16", "--batch-size", "4", "--world-size", "2", "--steps", "4",
              "--eval-every", "4", "--eval-windows", "8", "--quiet"]
    rate = 0.05
    experiment.main([*common, "--out", str(tmp_path / "host")])
    experiment.main([*common, "--out", str(tmp_path / "link"), "--link-gbps", str(rate)])
    host, link = (read_rows(tmp_path / d / "steps.csv") for d in ("host", "link"))
    assert [r["loss"] for r in host] == [r["loss"] for r in link]
    from gradcomp.emulate.links import MIN_BURST_BYTES
    sent = float(link[-1]["wire_bytes"])  # one rank's bytes over the run; tbf lets a burst through at once
    assert sent > MIN_BURST_BYTES
    assert sum(float(r["step_s"]) for r in link) >= (sent - MIN_BURST_BYTES) * 8 / (rate * 1e9)
    assert json.loads((tmp_path / "link" / "config.json").read_text())["link_gbps"] == rate


def test_time_to_loss_prices_measured_steps_then_the_tail():
    from examples.time_to_loss import parse_run, time_to_loss
    evals = [{"step": 50, "heldout_loss": 2.0}, {"step": 100, "heldout_loss": 1.5}, {"step": 150, "heldout_loss": 1.25}]
    link = [{"step": i + 1, "step_s": s} for i, s in enumerate([1.0, 0.5, 0.25, 0.25])]
    # 4 measured steps (2 s), then 96 at the tail's mean (the last 2: 0.25 s)
    assert time_to_loss(evals, link, 1.5) == {"target": 1.5, "reached": True, "steps": 100, "loss": 1.5,
                                              "link_steps": 4, "tail_s_per_step": 0.25, "seconds": 26.0}
    missed = time_to_loss(evals, link, 1.0, tail=4)  # never reached: the whole run, at the mean of all 4
    assert (missed["reached"], missed["steps"], missed["loss"], missed["seconds"]) == (False, 150, 1.25, 2.0 + 146 * 0.5)
    assert time_to_loss([{"step": 2, "heldout_loss": 1.0}], link, 1.0)["seconds"] == 1.5  # within the link run
    assert parse_run("a=b@c=d@e") == ("a", Path("b@c=d"), Path("e"))
    for bad, message in ((lambda: time_to_loss(evals, link[1:], 1.5), "1, 2, ... K"),
                         (lambda: time_to_loss(evals, link, 1.5, tail=5), "--tail"),
                         (lambda: time_to_loss([], link, 1.5), "no evaluations"),
                         (lambda: parse_run("a=b"), "LABEL=RUN@LINK")):
        with pytest.raises(ValueError, match=message):
            bad()


def test_seconds_to_step_by_blocks_drops_a_stalled_step_but_keeps_the_exact_ones():
    from examples.time_to_loss import seconds_to_step
    # blocks of 3: [0.5, 8.0 (a stall), 0.5] -> 0.5 each; [0.25, 0.25, 4.0] -> 0.25 each; a step
    # past the link run at the median of its second half (0.25, 0.25, 4.0)
    link = [{"step": i + 1, "step_s": s} for i, s in enumerate([0.5, 8.0, 0.5, 0.25, 0.25, 4.0])]
    assert seconds_to_step(link, 6) == 13.5  # every step as measured
    assert seconds_to_step(link, 6, block=3) == 3 * 0.5 + 3 * 0.25
    assert seconds_to_step(link, 8, block=3) == 3 * 0.5 + 3 * 0.25 + 2 * 0.25  # median of 0.25, 0.25, 4.0
    assert seconds_to_step(link, 6, block=3, exact={2}) == 0.5 + 8.0 + 0.5 + 3 * 0.25  # step 2 did other work
    with pytest.raises(ValueError, match="block must be >= 1"):
        seconds_to_step(link, 6, block=0)


def test_time_to_loss_target_is_a_number_or_a_runs_last_evaluation(tmp_path):
    from examples.time_to_loss import target_loss
    (tmp_path / "evals.csv").write_text("step,epoch,heldout_loss,heldout_accuracy\n50,0.1,2.5,0.3\n100,0.2,1.75,0.4\n")
    assert target_loss("1.5", experiment.read_csv) == 1.5
    assert target_loss(str(tmp_path), experiment.read_csv) == 1.75
    with pytest.raises(FileNotFoundError, match="neither a number nor a run folder"):
        target_loss(str(tmp_path / "missing"), experiment.read_csv)


def test_config_order_groups_hooks_then_rank():
    names = ["powersgd-r16", "sign-noef", "powersgd-r4-noef", "none", "powersgd-r4", "topk-0.5pct", "topk-1pct"]
    assert sorted(names, key=experiment.config_order) == [
        "none", "sign-noef", "topk-1pct", "topk-0.5pct", "powersgd-r4", "powersgd-r4-noef", "powersgd-r16"]


@pytest.mark.parametrize("low, high", [(1.5e5, 2.5e6), (2e5, 6e5), (3e5, 9e5), (5e4, 1.2e8)])
def test_log_axis_tick_labels_never_collide(low, high):
    """The curve figures' log axes (two panels, 13 x 5 in, 90 dpi as saved): no labelled minor
    tick ("3x10^5 4x10^5" collided), at least two labels however short the axis, none overlapping."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    by_step.plot([1, 2], [1, 0], label="run")
    by_bytes.plot(np.geomspace(low, high, 50), np.linspace(2.5, 0, 50))
    by_bytes.set(xscale="log")
    experiment.save_figure(plt, fig, (by_step, by_bytes), by_step, Path(os.devnull))
    FigureCanvasAgg(fig)
    fig.set_dpi(90)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    lo, hi = by_bytes.get_xlim()
    assert not [t.get_text() for t in by_bytes.xaxis.get_minorticklabels() if t.get_text()]
    labels = [t for t in by_bytes.xaxis.get_majorticklabels() if t.get_text() and lo <= t.get_position()[0] <= hi]
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert len(labels) >= 2, [t.get_text() for t in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), [t.get_text() for t in labels]
