"""The analyser against published measurements (gradcomp.published, docs/breakeven.md
"Against published measurements"), as a user would run it: every row predicted (a) from presets
and the stated hardware and (b) with the source's measured link where it gives one, nothing fitted
to the number checked. Every prediction the doc shows is recomputed here, and the summaries and
confusion tables from the rows."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from gradcomp import published as pub
from gradcomp.analysis import linkfit

ROWS = [m for m in pub.MEASUREMENTS if m.argv]
MEASURED = [m for m in ROWS if m.measured_argv]
DOC = Path(__file__).resolve().parent.parent / "docs" / "breakeven.md"


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("measurement", ROWS, ids=[m.key for m in ROWS])
def test_each_prediction_is_the_one_recorded(measurement):
    """(a) and (b) predict what the table says (to 0.1%)."""
    speedup, _ = pub.predict(measurement)
    assert speedup == pytest.approx(measurement.predicted, rel=1e-3), (
        f"{measurement.key}: the model now predicts {speedup:.3f}x where gradcomp/published.py records "
        f"{measurement.predicted}x (a); update RECORDED and docs/breakeven.md")
    if measurement.measured_argv:
        assert pub.predict(measurement, "measured")[0] == pytest.approx(measurement.predicted_measured, rel=1e-3)
    else:
        assert measurement.predicted_measured is None


@pytest.mark.parametrize("measurement", ROWS, ids=[m.key for m in ROWS])
def test_prediction_a_uses_presets_and_stated_hardware_only(measurement):
    """No achieved bandwidth in (a): links are presets (a bandwidth only as a preset's nominal share
    of a NIC), no measured all-reduce; (b) adds a measured link and nothing else fitted."""
    a = measurement.argv
    assert "--intra-gbps" not in a and "--allreduce-ms" not in a and "--busbw" not in a and "--efficiency" not in a
    assert flag(a, "--link") is not None or flag(a, "--intra-link") is not None  # one server: its preset link
    if flag(a, "--bandwidth-gbps") is not None:
        nominal = {"40gbe": 40, "ib-qdr": 32, "25gbe": 25, "10gbe": 10, "100gbe": 100}
        gpus = int(flag(a, "--gpus-per-node"))
        assert float(flag(a, "--bandwidth-gbps")) * gpus <= nominal[flag(a, "--link")] * 1.0001


def test_the_measured_link_is_the_1bit_adam_papers_table1():
    """(b): the 64-GPU row gives Table 1's all-reduce times as measured; the other rows of the same
    Ethernet cluster take the achieved bandwidths they fit (within 1% of the rounded ones)."""
    e2e = next(m for m in ROWS if m.key == "1bit-adam-e2e-64")
    assert flag(e2e.measured_argv, "--allreduce-ms") == "intra=239.76,inter=2259.36"
    args, _, _ = pub._scenario_and_choices(e2e.measured_argv)
    for level in ("intra", "inter"):
        assert args.measured_links[level].gbps == pytest.approx(float(pub.TABLE1_LINK[level]), rel=0.01)
    assert {m.key for m in MEASURED} == {m.key for m in ROWS if m.key.startswith("1bit-adam")
                                         and ("tcp" in m.key or "e2e" in m.key)}


def test_the_implied_links_reproduce_the_sources_step():
    """The links the sources' own uncompressed steps imply (kept for the spread of achieved
    fractions, never used to predict) are within 1% of the fit (three rows: the fit is slow)."""
    for key, level in (("1bit-adam-ib-4", "--intra-gbps"), ("1bit-adam-tcp-16", "--bandwidth-gbps"),
                       ("byteps-cifar100-onebit-32", "--bandwidth-gbps")):
        m = next(r for r in ROWS if r.key == key)
        assert pub.fit_bandwidth(m, level) == pytest.approx(float(flag(m.implied_argv, level)), rel=0.01)


def test_the_plausible_fractions_are_the_implied_links():
    """linkfit.PLAUSIBLE_FRACTIONS' ends for TCP and InfiniBand are the smallest and largest fraction
    of nominal the published clusters' implied links reach (per node: a GPU's share x its GPUs)."""
    fractions = {"tcp": [], "ib": []}
    for m in ROWS:
        inter = flag(m.implied_argv, "--bandwidth-gbps")
        if inter is None or m.key.startswith(("cgx", "byteps")):
            continue
        gpus = int(flag(m.argv, "--gpus-per-node"))
        node_gbps = float(inter) * gpus
        nominal = (40 if "tcp" in m.key or "e2e" in m.key else 32) if m.key.startswith("1bit") else \
            int(re.search(r"(\d+)gbps", m.key).group(1))
        fractions["ib" if "-ib-" in m.key else "tcp"].append(node_gbps / nominal)
    for transport, values in fractions.items():
        spread = linkfit.PLAUSIBLE_FRACTIONS[transport]
        assert min(values) == pytest.approx(spread.low, abs=0.006)
        if transport == "tcp":
            assert max(values) == pytest.approx(spread.high, abs=0.006)


def test_the_summaries_are_what_the_doc_states():
    """The confusion tables count the rows' verdicts; the doc shows pub.table() as it is now."""
    for which, predicted in (("preset", lambda m: m.predicted), ("measured", lambda m: m.predicted_measured)):
        s = pub.summary(which=which)
        rated = [m for m in pub.MEASUREMENTS if m.published is not None and predicted(m) is not None]
        assert s["rows"] == len(rated) == sum(sum(row.values()) for row in s["confusion"].values())
        assert s["verdicts_agree"] == sum(pub.verdict(m.published) == pub.verdict(predicted(m)) for m in rated)
        factors = sorted(math.exp(abs(math.log(m.published / predicted(m)))) for m in rated)
        assert s["median_factor"] == pytest.approx(factors[len(factors) // 2] if len(factors) % 2 else
                                                   (factors[len(factors) // 2 - 1] + factors[len(factors) // 2]) / 2)
    text = DOC.read_text()
    assert pub.table() in text, "docs/breakeven.md must show pub.table() as it is now"
    for m in pub.MEASUREMENTS:
        assert f"`{m.key}`" in text


def test_every_row_names_its_source_and_how_it_was_read():
    for m in pub.MEASUREMENTS:
        assert m.source and m.how and m.setting
        assert (m.predicted is None) == (not m.argv)
        assert m.published is None or (m.published > 0 and math.isfinite(m.published))
        if m.published is None:
            assert "not" in m.how  # says it could not be verified
    urls = " ".join(m.source for m in pub.MEASUREMENTS)
    assert re.search(r"deepspeed\.ai/2020/09/08/onebit-adam-blog-post", urls) and "arXiv 2102.02888" in urls
    assert "bytedance/byteps/blob/master/docs/gradient-compression.md" in urls and "pytorch-cgx.github.io" in urls
    assert "tutorials.baguasys.com/benchmark" in urls
    assert "sands-lab/grace-data" in urls
    byteps = next(m for m in pub.MEASUREMENTS if m.key == "byteps-cifar100-onebit-32")
    assert "k = 1 for topk and k = 8 for randomk" in byteps.how


def test_the_readme_states_the_check_as_it_is():
    """README's "Does it pay?" figures are the summaries `breakeven_validation.py --published` prints."""
    readme = (DOC.parent.parent / "README.md").read_text()
    a, b = pub.summary(which="preset"), pub.summary(which="measured")
    assert f"{a['verdicts_agree']} of {a['rows']} verdicts agree" in readme
    assert f"typical prediction is {a['median_factor']:.2f}x off" in readme
    assert f"({b['rows']} rows), {b['verdicts_agree']} agree and a typical prediction is {b['median_factor']:.2f}x off" \
        in " ".join(readme.split())
    assert "python benchmarks/breakeven_validation.py --published" in readme


def test_powersgd_cut_is_what_the_doc_states():
    """PowerSGD rank 2's cut of ResNet-18's communication (16 GPUs) over the preset settings, as the
    doc states it: each cut is 1 - PowerSGD's network seconds / SGD's."""
    from gradcomp.analysis import Choice, make_scenario, simulate

    cuts = pub.powersgd_cut_grid()
    first = cuts[0]
    scenario = make_scenario("resnet18-cifar", 16, first["device"], first["link"], gpus_per_node=first["gpus_per_node"])
    assert first["cut"] == 1 - simulate(scenario, Choice("powersgd", {"rank": 2})).comm_s / simulate(
        scenario, Choice("none")).comm_s
    lo, hi = min(c["cut"] for c in cuts), max(c["cut"] for c in cuts)
    within = sum(pub.POWERSGD_CUT / 1.5 <= c["cut"] <= pub.POWERSGD_CUT * 1.5 for c in cuts)
    text = " ".join(DOC.read_text().split())
    assert f"The cut is {lo:.0%}-{hi:.0%}: within 1.5x of 54%" in text and f"in {within} of {len(cuts)}," in text


def test_the_check_covers_both_outcomes_and_five_implementations():
    """At least five rows where compression did not pay and rows from at least five implementations,
    each GRACE row's published figure the ratio of the two runs its `how` names, its compute the
    1-worker run at the assumed batch (nothing from the runs checked)."""
    s = pub.summary(which="preset")
    assert s["agree_by_outcome"]["does not pay"][1] >= 5
    assert len(s["implementations"]) >= 5
    grace = [m for m in ROWS if m.key.startswith("grace-")]
    assert len(grace) == 8
    for m in grace:
        ours, none = (float(x) for x in re.findall(r"\) ([0-9.]+) images/s", m.how))
        assert m.published == pytest.approx(ours / none, abs=5e-4)
        assert float(flag(m.argv, "--compute-ms")) == pytest.approx(64 / 365.934702 * 1e3, rel=1e-3)
        assert flag(m.argv, "--gpus-per-node") == "1" and flag(m.argv, "--link") in ("10gbe", "25gbe")


def test_grace_schemes_send_the_bytes_grace_measured():
    """Each GRACE row whose method has a data-volume run is priced with a scheme sending what that run
    measured a worker sends a step (within 2%): top-k 1% and 8-bit as gradcomp's, signSGD (a byte per
    sign in GRACE's TensorFlow compressor) as int8:allgather, since gradcomp's sign:allgather packs 8
    signs a byte."""
    from gradcomp.analysis.costmodel import Choice, simulate

    for method, (run, volume) in pub.GRACE_DATA_VOLUME.items():
        for m in (r for r in ROWS if r.key.startswith(f"grace-resnet50-{method}-")):
            _, scenario, choices = pub._scenario_and_choices(m.argv)
            priced = next(c for c in choices if c.label == m.compare)
            assert simulate(scenario, priced).wire_bytes == pytest.approx(volume, rel=0.02), m.key
            assert run in m.note and f"{volume:,}" in m.note
    signsgd = next(m for m in ROWS if m.key == "grace-resnet50-signsgd-8-10g")
    _, scenario, _ = pub._scenario_and_choices(signsgd.argv)
    assert simulate(scenario, Choice.parse("sign:allgather")).wire_bytes < pub.GRACE_DATA_VOLUME["signsgd"][1] / 7


def test_no_row_is_given_a_compressor_cost_its_source_does_not_state():
    """No source states another implementation's compress or decompress time apart from the speedup,
    so no row gives one (a --profile); each GRACE row prices GRACE's own TensorFlow compressor from its
    code (--implementation: the compressor and its memory as the run's columns name them, nothing from
    a timing); GRACE's upper-bound runs are named in their rows' notes and used nowhere (the compressor
    cost they would give contains the row's own compressed run)."""
    for m in ROWS:
        assert "--profile" not in m.argv + m.measured_argv
        assert ("--implementation" in m.argv) == m.key.startswith(("grace-", "1bit-adam-"))
        if m.key.startswith("1bit-adam-"):  # DeepSpeed's 2020 compressed all-reduce, (a) and (b) alike
            assert flag(m.argv, "--implementation") == flag(m.measured_argv or m.argv, "--implementation") \
                == "deepspeed-2020:onebit"
    grace = {m.key: m for m in ROWS if m.key.startswith("grace-")}
    for key, m in grace.items():
        compressor = key.split("-")[2]
        memory = re.search(r"memory (\w+)", m.how).group(1)
        assert flag(m.argv, "--implementation") == (f"grace-tf:{pub._GRACE_COMPRESSOR[compressor]}"
                                                    + (":memory" if memory == "true" else ""))
    assert set(pub.GRACE_UPPER_BOUND) == {k for k in grace if not k.endswith("-nccl")}
    for key, (run, images_s) in pub.GRACE_UPPER_BOUND.items():
        m = grace[key]
        assert f"upper-bound run {run}: {images_s:.1f} images/s, recorded, not used" in m.note
        assert not any(run in arg or f"{images_s:.4g}" in arg for arg in m.argv)


def test_grace_compressor_is_priced_from_its_ops():
    """gradcomp.analysis.implementations: a compressor's cost is its ops' kernel launches (the device
    preset's launch_us each) per tensor and their bytes at the preset's copy bandwidth, nothing else;
    each payload's decode ops are paid p times (GRACE's all-gather decodes every rank's payload)."""
    from gradcomp.analysis import implementations, presets

    v100 = presets.device("v100")
    signsgd = implementations.parse("grace-tf:signsgd")
    cost = signsgd.method_cost(v100, world=8)
    launch, per_byte = v100.launch_us * 1e-6, 1 / (v100.memory_gbps * 1e9)
    assert cost.per_tensor_s == pytest.approx(1 * launch)  # greater_equal
    assert cost.compress.per_element_s == pytest.approx(5 * per_byte)
    payload_kernels = sum(op.kernels for op in signsgd.ops.payload)
    once_kernels = sum(op.kernels for op in signsgd.ops.once)
    assert cost.per_tensor_decode_s == pytest.approx((8 * payload_kernels + once_kernels) * launch)
    assert cost.decompress_s(1000, 8) == pytest.approx(
        1000 * (8 * sum(op.dense for op in signsgd.ops.payload) + sum(op.dense for op in signsgd.ops.once)) * per_byte)
    # top-k's bytes follow its ratio; its memory adds ops; names are checked
    topk = implementations.parse("grace-tf:topk")
    assert topk.method_cost(v100, 8, 0.1).compress.per_element_s > topk.method_cost(v100, 8, 0.01).compress.per_element_s
    assert implementations.parse("grace-tf:topk:memory").method_cost(v100, 8).per_tensor_s > \
        topk.method_cost(v100, 8).per_tensor_s
    with pytest.raises(ValueError, match="grace-tf:topk"):
        implementations.parse("grace-tf:qsgd")


def test_grace_costs_are_paid_per_tensor():
    """The framework ops' launches are charged per tensor in a bucket (GRACE compresses tensor by
    tensor): ResNet-50's 161 tensors, the step's compress time at least 161 x the per-tensor launches;
    gradcomp's own kernels (no --implementation) keep their per-bucket costs."""
    from gradcomp.analysis.costmodel import simulate

    m = next(r for r in ROWS if r.key == "grace-resnet50-signsgd-8-10g")
    _, scenario, choices = pub._scenario_and_choices(m.argv)
    choice = next(c for c in choices if c.label == m.compare)
    cost = scenario.profile.method("int8")
    assert len(scenario.model.parameters) == 161
    assert simulate(scenario, choice).compress_s >= 161 * (cost.per_tensor_s + cost.per_tensor_decode_s)
    plain = [a for i, a in enumerate(m.argv) if a != "--implementation" and m.argv[i - 1] != "--implementation"]
    _, own, _ = pub._scenario_and_choices(plain)
    assert own.profile.method("int8").per_tensor_decode_s == 0
    assert simulate(own, choice).compress_s < simulate(scenario, choice).compress_s / 5


def test_grace_powersgd_view_sends_what_its_code_sends():
    """GRACE's TensorFlow PowerSGD views a conv kernel [kh, kw, in, out] as [kh, kw * in * out] (a dense
    kernel [in, out] as it is; 1-D sent whole): at rank 1 ResNet-50 sends 63.8 MB a worker a step, where
    gradcomp's own view sends under 1 MB. GRACE's data-volume run of PowerSGD (kmdmxgmz0) counted 54.7 MB:
    the view is 17% above it (what that run's debug log counts is not known); nothing is fitted to it."""
    from gradcomp.analysis.costmodel import simulate
    from gradcomp.analysis.implementations import tf_matrix_view

    assert tf_matrix_view((64, 3, 7, 7), 1) == (7, 7 * 3 * 64, 1)  # conv [out, in, kh, kw]
    assert tf_matrix_view((256, 64, 1, 1), 1) == (1, 64 * 256, 1)  # a 1 x 1 conv: its whole kernel in Q
    assert tf_matrix_view((1000, 2048), 1) == (2048, 1000, 1)  # linear [out, in] is TensorFlow's [in, out]
    assert tf_matrix_view((64,), 1) is None
    m = next(r for r in ROWS if r.key == "grace-resnet50-powersgd-8-10g")
    _, scenario, choices = pub._scenario_and_choices(m.argv)
    choice = next(c for c in choices if c.label == "powersgd")
    wire = simulate(scenario, choice).wire_bytes
    assert wire == pytest.approx(63.84e6, rel=0.01)
    assert 1.1 < wire / 54.7e6 < 1.2


def test_a_constant_verdict_cannot_score():
    """The per-outcome agreement is what can say no: a predictor that always says "pays" agrees on
    every paying row and on none of the others, one that always says "does not pay" the reverse."""
    from dataclasses import replace

    for constant, outcome in ((2.0, "pays"), (0.5, "does not pay")):
        rows = [replace(m, predicted=constant) for m in pub.MEASUREMENTS if m.predicted is not None]
        s = pub.summary(rows)
        for o, (agree, of) in s["agree_by_outcome"].items():
            assert agree == (of if o == outcome else 0)
        assert s["agree_by_outcome"]["pays"][1] >= 5 and s["agree_by_outcome"]["does not pay"][1] >= 5


def test_tensorflow_top_k_is_priced_as_one_thread_block_sorting():
    """Rule 3: TensorFlow's top_k of a flattened tensor (k >= 100) is CUB's segmented radix sort with one
    segment, which CUB runs on one thread block: its 80 bytes an element at one SM's share of the copy
    bandwidth (80 SMs on a V100); the rest of the ops at the full copy bandwidth."""
    from gradcomp.analysis import implementations, presets

    v100 = presets.device("v100")
    per_byte = 1 / (v100.memory_gbps * 1e9)
    cost = implementations.parse("grace-tf:topk").method_cost(v100, 8, 0.01)
    dense = 8 + 4 + 80 * implementations.SMS["v100"]  # abs, the indices, the sort on one SM's share
    sparse = 16 + 12 + 16  # the first k copied out, the gather, the concat
    assert cost.compress.per_element_s == pytest.approx((dense + sparse * 0.01) * per_byte)
    assert implementations.SMS["v100"] == 80


def test_deepspeed_2020_onebit_is_priced_per_call_from_its_ops():
    """Rule 6: DeepSpeed 0.3's Compressed_Allreduce on the flat fp32 momentum: 100.125 bytes an element of
    worker ops (the same on the server's chunk), 30.125 a payload decoded plus 4 read by the sum, its
    launches once a call (not per tensor); every 1-bit Adam row prices it."""
    from gradcomp.analysis import implementations, presets

    v100 = presets.device("v100")
    per_byte = 1 / (v100.memory_gbps * 1e9)
    onebit = implementations.parse("deepspeed-2020:onebit")
    assert onebit.method == "sign"
    cost = onebit.method_cost(v100, 4)
    assert cost.compress.per_element_s == pytest.approx(100.125 * per_byte)
    assert cost.decompress.per_element_s == pytest.approx(34.125 * per_byte)
    assert cost.per_tensor_s == cost.per_tensor_decode_s == 0
    assert cost.compress.fixed_s == pytest.approx(sum(o.kernels for o in onebit.ops.compress) * v100.launch_us * 1e-6)


def test_implementation_is_refused_with_a_profile_and_named_in_the_output(tmp_path):
    """--implementation prices from the device preset, so it refuses a measured --profile; the command's
    output says which method it priced that way."""
    from gradcomp.analysis import preset_profile, presets
    from gradcomp.cli import _step_source, build_parser, _scenario_from_args

    argv = ["breakeven", "--model", "resnet50", "--device", "v100", "--world-size", "8", "--link", "10gbe",
            "--implementation", "grace-tf:topk", "--set", "topk.ratio=0.01", "--compute-ms", "174.9"]
    args = build_parser().parse_args(argv)
    scenario = _scenario_from_args(args)
    assert "topk priced as grace-tf:topk's ops" in _step_source(args, scenario)
    profile = tmp_path / "profile.json"
    preset_profile(presets.device("v100")).save(profile)
    args = build_parser().parse_args(argv + ["--profile", str(profile)])
    with pytest.raises(ValueError, match="--implementation prices another implementation"):
        _scenario_from_args(args)
