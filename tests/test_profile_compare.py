"""profile_train.py --compare: several sweeps of one setup side by side."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

import profile_train

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


def test_compare_names_a_gpus_peak_in_tflops(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A GPU's matmul peak reads in TFLOP/s in --compare, as in the report; in the listing
    and in the refusal of two machines of different speed."""
    folders = []
    for i, peak in enumerate([7.0e14, 7.1e14]):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"].update(peak_flops=peak, peak_flops_end=peak)
        results["meta"]["other_cpu_share"] = 0.0  # not the load the fixture's sweep met here
        results["meta"]["started_at"] = f"2026-11-30T1{i}:00:00+00:00"
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert ", matmul peak 700.0 TFLOP/s" in printed and "GFLOP/s" not in printed
    results["meta"].update(peak_flops=3.5e14)
    (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in matmul peak" in err and "350.0 TFLOP/s" in err
    results["meta"].update(peak_flops=9.5e12, peak_flops_end=9.5e12)  # beside 700 TFLOP/s
    (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "9.5 TFLOP/s" in err and "GFLOP/s" not in err


def test_compare_reads_the_savings_of_several_sweeps(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Four sweeps whose inplace saves 1, 2, 3 and 4 ms a layer: each column, then the median,
    numpy's quartiles and the range across them, of each label's cost per layer and of its
    saving; a setup that differs is refused by name."""
    folders = []
    for i, per_layer in enumerate([1.0, 4.0, 2.0, 3.0]):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-11-30T1{i}:00:00+00:00"
        results["meta"]["other_cpu_share"] = 0.0  # not the load the fixture's sweep met here
        for r in results["rows"]:
            cost = {"naive": 10.0, "inplace": 10.0 - per_layer}.get(r["variant"], 9.0)
            ms = 5.0 + cost * r["n_layer"] + (0.1 if r["n_layer"] == 2 else 0)
            r["step_ms"].update(median=ms, p10=ms - 0.05, p90=ms + 0.05)
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    step_times, costs, fitted, measured = printed.split("## ")[1:]
    # inplace at L2: 5 + (10 - s) * 2 + 0.1 with s = 1, 4, 2, 3: 23.1, 17.1, 21.1, 19.1
    assert "| inplace | 12.5 (11.0–14.0) | 20.1 (17.1–23.1) |" in step_times
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0) |" in step_times
    # Cost per layer: naive's slope is 10 in every sweep, inplace's 10 - s; no sign, as a cost
    assert costs.startswith("Cost per layer, fitted (ms/layer ± se)")
    rows = {
        line.split("|")[1].strip(): line for line in costs.splitlines() if line.startswith("| ")
    }
    naive = [c.strip() for c in rows["naive"].strip("|").split("|")]
    assert all(c.startswith("10.00 ± ") for c in naive[1:5]) and naive[5:] == [
        "10.00",
        "10.00, 10.00",
        "10.00 to 10.00",
    ]
    cells = [c.strip() for c in rows["inplace"].strip("|").split("|")]
    assert [c.split(" ± ")[0] for c in cells[1:5]] == ["9.00", "6.00", "8.00", "7.00"]
    assert cells[5:] == ["7.50", "6.75, 8.25", "6.00 to 9.00"]
    inplace = next(line for line in fitted.splitlines() if line.startswith("| inplace |"))
    cells = [c.strip() for c in inplace.strip("|").split("|")]
    assert [c.split(" ± ")[0] for c in cells[1:5]] == ["+1.00", "+4.00", "+2.00", "+3.00"]
    assert all(" ± " in c for c in cells[1:5])  # three depths: each fit has its error
    assert cells[5:] == ["+2.50", "+1.75, +3.25", "+1.00 to +4.00"]
    assert np.percentile([1, 2, 3, 4], [25, 75]).tolist() == [1.75, 3.25]
    assert "n_layer=3, measured" in measured
    assert "| inplace | +3.00 | +12.00 | +6.00 | +9.00 | +7.50 |" in measured
    assert "| naive |" not in fitted + measured  # the reference saves nothing against itself
    assert "2026-11-30 10:00 UTC" in printed
    assert "§" not in printed
    # Other processes slowed the second sweep (its report warned): marked, not in the median
    busy = json.loads((folders[1] / "results.json").read_text())
    busy["meta"]["other_cpu_share"] = 0.28
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert f"`{folders[1]}`: " in printed and ", other processes 28% of the CPUs §" in printed
    # Its step times too: inplace at L2 is 17.1 there, 23.1, 21.1 and 19.1 in the others
    assert "| inplace | 13.0 (12.0–14.0), 3 of 4 | 21.1 (19.1–23.1), 3 of 4 |" in printed
    inplace = next(line for line in printed.split("## ")[3].splitlines() if "| inplace |" in line)
    cells = [c.strip() for c in inplace.strip("|").split("|")]
    assert cells[2].startswith("+4.00 ± ") and cells[2].endswith(" §")
    assert cells[5:] == ["+2.00", "–", "+1.00 to +3.00"]  # the other three: 1, 2, 3
    inplace = next(line for line in printed.split("## ")[2].splitlines() if "| inplace |" in line)
    cells = [c.strip() for c in inplace.strip("|").split("|")]  # its cost: 6 marked, left out
    assert cells[2].startswith("6.00 ± ") and cells[2].endswith(" §")
    assert cells[5:] == ["8.00", "–", "7.00 to 9.00"]
    assert "§ Other processes used more than 10% of the CPUs" in printed
    # They slow the matmul peak too: a busy sweep's is not another machine's
    busy["meta"].update(peak_flops=busy["meta"]["peak_flops"] / 2)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    inplace = next(line for line in printed.split("## ")[3].splitlines() if "| inplace |" in line)
    assert [c.strip() for c in inplace.strip("|").split("|")][5:] == [
        "+2.00",
        "–",
        "+1.00 to +3.00",
    ]
    # ...but not higher: a busy sweep twice as fast as the quiet ones is another machine
    busy["meta"].update(peak_flops=busy["meta"]["peak_flops"] * 4)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    assert "differ in matmul peak" in capsys.readouterr().err
    busy["meta"].update(other_cpu_share=0.02, peak_flops=busy["meta"]["peak_flops"] / 2)
    (folders[1] / "results.json").write_text(json.dumps(busy))
    # profiles/<config>/* takes `latest` too, a link to the newest sweep: counted once.
    # A sweep stopped before its first cell left a folder with no results.json: left out.
    (tmp_path / "latest").symlink_to(folders[-1].name)
    (tmp_path / "stopped").mkdir()
    also = [str(tmp_path / "latest"), str(tmp_path / "stopped"), str(folders[0])]
    assert profile_train.main(["--compare", *map(str, folders), *also]) == 0
    printed, err = capsys.readouterr()
    assert f"{tmp_path / 'latest'} is {folders[-1]}, counted once" in err
    assert f"{folders[0]} given twice, counted once" in err
    assert f"{tmp_path / 'stopped'} holds no results.json" in err
    assert printed.startswith("# 4 sweeps of one setup")
    # One sweep, named twice: nothing to compare, and the count says why
    assert profile_train.main(["--compare", str(folders[0]), str(folders[0])]) == 2
    assert "give two sweep folders or more (1 left of the 2 given, as said above)" in (
        capsys.readouterr().err
    )

    # naive failed at n_layer=3 in the first: its inplace saving is fitted over L1,2 only,
    # another quantity, shown marked and left out of the median.
    first = json.loads((folders[0] / "results.json").read_text())
    for r in first["rows"]:
        if (r["variant"], r["n_layer"]) == ("naive", 3):
            r["status"] = "oom"
    (folders[0] / "results.json").write_text(json.dumps(first))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert "| inplace | +1.00 ‡ (L1,2) | +4.00 ± " in printed
    assert "| naive | 10.10 ‡ (L1,2) | 10.00 ± " in printed  # its cost, over those two as well
    assert "| +3.00 | – | +2.00 to +4.00 |" in printed and "‡ Fitted over fewer depths" in printed
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0), 3 of 4 |" in printed

    for change, named in [
        (lambda m: m["config"]["model"].update(n_embd=256), "model"),
        (lambda m: m["config"]["train"].update(grad_accum=2), "micro-batches"),
        (lambda m: m.update(host_memory="release"), "host memory"),
        (lambda m: m.update(heap_reserve_bytes=1 << 30), "heap reserve"),
        (lambda m: m["config"]["train"].update(grad_clip=0.0), "the optimizer step"),
        (lambda m: m["config"]["train"].update(weight_decay=0.0), "the optimizer step"),
        (lambda m: m.update(data="stdlib"), "data"),
        # A VM of the same name with half the matmul peak: another machine
        (lambda m: m.update(peak_flops=m["peak_flops"] / 2), "matmul peak"),
    ]:
        changed = copy.deepcopy(results)
        change(changed["meta"])
        (folders[-1] / "results.json").write_text(json.dumps(changed))
        assert profile_train.main(["--compare", *map(str, folders)]) == 2
        err = capsys.readouterr().err
        assert f"differ in {named}" in err and str(folders[-1]) in err
    # Interrupted after two depths: compared where it measured, its saving fitted over those
    # two marked, and its deepest cells and the saving measured there left empty.
    cut = copy.deepcopy(results)
    planned = cut["meta"]["cells_planned"]
    cut["rows"] = [r for r in cut["rows"] if r["n_layer"] <= 2]
    (folders[-1] / "results.json").write_text(json.dumps(cut))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    printed = capsys.readouterr().out
    assert f", stopped after {len(cut['rows'])} of {planned} cells" in printed
    # Stopped while profiling its deepest cells: those timed only do not make it whole.
    timed = copy.deepcopy(results)
    for r in timed["rows"]:
        if r["n_layer"] == 3:
            r["status"] = "interrupted"
    (folders[-1] / "results.json").write_text(json.dumps(timed))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    done = sum(r["n_layer"] < 3 for r in timed["rows"])
    assert f", stopped after {done} of {planned} cells" in capsys.readouterr().out
    # Every sweep stopped so: compared at the depths they measured, 1 and 2
    saved = [(folder / "results.json").read_text() for folder in folders[:-1]]
    for i, folder in enumerate(folders[:-1]):
        again = copy.deepcopy(timed)
        again["meta"]["started_at"] = f"2026-12-01T0{i}:00:00+00:00"
        (folder / "results.json").write_text(json.dumps(again))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    compared = capsys.readouterr().out
    assert "n_layer 1,2." in compared and "Saving at n_layer=2, measured" in compared
    for folder, text in zip(folders[:-1], saved, strict=True):
        (folder / "results.json").write_text(text)
    # naive at L3: failed in the first sweep (above), not reached in the last
    assert "| naive | 15.0 (15.0–15.0) | 25.1 (25.1–25.1) | 35.0 (35.0–35.0), 2 of 4 |" in printed
    assert "| +3.00 ‡ (L1,2) |" in printed and "(a cell failed, or the sweep stopped" in printed
    assert "| inplace | – | +12.00 | +6.00 | – |" in printed
    # A whole sweep of other depths is another setup; a stopped one is named as the likely cause.
    other = copy.deepcopy(results)
    other["rows"] += [dict(r, n_layer=4) for r in other["rows"] if r["n_layer"] == 1]
    other["meta"]["cells_planned"] = len(other["rows"])  # ran to the end, at 1, 2, 3 and 4
    (folders[-1] / "results.json").write_text(json.dumps(other))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in n_layer" in err and "stopped before the end" not in err
    cut["rows"] = [r for r in other["rows"] if r["n_layer"] in (1, 4)]  # stopped, at 1 and 4
    cut["meta"]["cells_planned"] = len(other["rows"])
    (folders[-1] / "results.json").write_text(json.dumps(cut))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert "differ in n_layer" in err
    assert f"stopped before the end: {folders[-1]}, {len(cut['rows'])} of " in err
    other_clip = copy.deepcopy(results)  # another clip norm is the same work
    other_clip["meta"]["config"]["train"]["grad_clip"] = 0.5
    (folders[-1] / "results.json").write_text(json.dumps(other_clip))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    capsys.readouterr()

    # Sweeps of one depth: no line to fit, said so, not an empty table.
    for folder in folders[:2]:
        one = json.loads((folder / "results.json").read_text())
        one["rows"] = [r for r in one["rows"] if r["n_layer"] == 1]
        (folder / "results.json").write_text(json.dumps(one))
    assert profile_train.main(["--compare", *map(str, folders[:2])]) == 0
    printed = capsys.readouterr().out
    assert "(none: a fit needs two depths" in printed
    assert "Each sweep's ± is" not in printed, "no ± shown: none explained"
    for refused in (
        [str(folders[0])],  # one sweep has no spread
        [str(folders[0]), str(folders[0])],  # the same sweep twice
        [str(folders[0]), str(tmp_path)],  # no results.json
        [str(folders[0]), str(folders[1]), "--steps", "5"],  # a setting for a new sweep
    ):
        assert profile_train.main(["--compare", *refused]) == 2, refused
        assert "--compare" in capsys.readouterr().err
    # One edited by hand into what the comparison cannot read: that one is named
    edited = json.loads((folders[1] / "results.json").read_text())
    for edit in ("step_ms", "peak_flops"):  # read by the tables; by the check of the setups
        damaged = copy.deepcopy(edited)
        if edit == "step_ms":
            damaged["rows"][0]["step_ms"] = "fast"
        else:
            del damaged["meta"]["peak_flops"]
        (folders[1] / "results.json").write_text(json.dumps(damaged))
        assert profile_train.main(["--compare", *map(str, folders)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folders[1] / 'results.json'}: "), err


def test_compare_refuses_bfloat16_sweeps_held_to_peaks_of_other_dtypes() -> None:
    """A bfloat16 sweep on a CPU without bf16 instructions divides by float32's peak; one from
    before that divided by bfloat16's: their MFUs and peaks are not one quantity."""
    from profiling.compare import comparable

    meta = {"device_name": "AMD EPYC", "torch_version": "2.13.0", "dtype": "bfloat16"}
    meta["config"] = {"model": {}, "train": {"batch_size": 8}}
    older, newer = {"meta": meta, "rows": []}, {"meta": meta | {"peak_dtype": "float32"}}
    problem = comparable([(Path("older"), older), (Path("newer"), newer | {"rows": []})])
    assert problem is not None
    assert problem.startswith("the sweeps differ in the matmul peak's dtype (older: bfloat16; ")


def test_compare_of_sweeps_stopped_in_their_first_depth_says_so(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Sweeps stopped while their first depth was timed or profiled hold interrupted rows
    only: no depth to compare, said in one line, not an IndexError."""
    folders = []
    for i in range(2):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-12-0{i + 1}T10:00:00+00:00"
        results["rows"] = [dict(r, status="interrupted") for r in results["rows"]]
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    assert "--compare: no depth to compare: every sweep stopped" in capsys.readouterr().err


def test_compare_of_sweeps_of_one_depth_fits_nothing_and_says_why(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Sweeps of one depth each: their step times side by side, and in place of each fitted
    table the reason it is empty, rather than a header with no rows."""
    folders = []
    for i in range(2):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-12-0{i + 1}T10:00:00+00:00"
        results["meta"]["other_cpu_share"] = 0.0
        results["rows"] = [r for r in results["rows"] if r["n_layer"] == 1]
        results["meta"]["cells_planned"] = len(results["rows"])
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0
    _, step_times, costs, fitted, measured = capsys.readouterr().out.split("## ")
    assert "| naive | " in step_times and "n_layer=1" in measured
    assert costs.splitlines()[2] == "(none: a fit needs two depths)"
    assert fitted.splitlines()[2].startswith("(none: a fit needs two depths, and a saving naive")


def test_compare_refuses_sweeps_that_share_no_variant(
    naive_vs_inplace: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An eager sweep beside a compiled one: `naive` is not `naive+compile`, so every column
    would be – and every median empty. Refused, naming the sweep and each one's labels; one
    label in common is enough."""
    folders = []
    for i, compiled in enumerate((False, True)):
        results = copy.deepcopy(naive_vs_inplace)
        results["meta"]["started_at"] = f"2026-12-0{i + 1}T10:00:00+00:00"
        results["rows"] = [dict(r, compile=compiled) for r in results["rows"]]
        folders.append(tmp_path / f"s{i}")
        folders[-1].mkdir()
        (folders[-1] / "results.json").write_text(json.dumps(results))
    assert profile_train.main(["--compare", *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert f"--compare: {folders[0]} shares no variant with the other sweeps" in err, err
    assert f"{folders[1]}: naive+compile, inplace+compile" in err, err
    both = json.loads((folders[1] / "results.json").read_text())
    both["rows"] += naive_vs_inplace["rows"]  # --compile both: its eager cells are shared
    (folders[1] / "results.json").write_text(json.dumps(both))
    assert profile_train.main(["--compare", *map(str, folders)]) == 0, capsys.readouterr().err
