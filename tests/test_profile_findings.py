"""Op diffs between variants and the findings in words: the ops and kernels each adds or removes
per layer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from model import attention
from profiling.analysis import op_diff
from profiling.measure import verify_backend
from sweeps import ROOT, split_row, sweep
from tiny_runs import run_argv
from training.checkpoint import CHECKPOINT
from training.probe import BACKEND_OPS

# The stand-ins of sweeps.py, for every test here.
pytestmark = pytest.mark.usefixtures("quick_peak", "flops_counted_once", "plots_unrendered")


def _ops_row(variant: str, n: int, forward: dict, backward: dict | None = None) -> dict:
    ops = {"forward": forward, "backward": backward or {}, "optimizer": {}}
    return {"variant": variant, "compile": False, "n_layer": n, "status": "ok", "ops_per_step": ops}


def test_op_diff_when_one_variant_has_a_single_depth() -> None:
    """A sweep cut short leaves some variants at fewer depths: compare at a shared depth, say
    that the whole step's difference was divided by n_layer, and order by size as usual."""
    from profiling.analysis import describe_diff

    def row(variant: str, n: int, clones: int, adds: int, mm: int) -> dict:
        return _ops_row(variant, n, {"aten::add": adds, "aten::clone": clones, "aten::mm": mm})

    rows = [
        row("naive", 1, 5, 2, 4),
        row("naive", 2, 10, 4, 8),
        row("sdpa", 2, 4, 2, 8),
    ]
    diffs = op_diff(rows, "sdpa", "naive")
    assert diffs == [
        {"region": "forward", "name": "aten::clone", "per_layer": -3.0, "one_depth": 2},
        {"region": "forward", "name": "aten::add", "per_layer": -1.0, "one_depth": 2},
    ]
    text = describe_diff("sdpa", "naive", diffs)
    assert "one depth in common (n_layer=2): the whole step's difference divided by 2" in text
    assert "per layer per step" not in text
    full = describe_diff("sdpa", "naive", diffs, full=True)
    assert "one depth in common (n_layer=2)" in full
    # At one depth the counts are exact: one op more per step is shown however deep the model
    # (one outside the layers at n_layer=8 is 0.125 per layer, under the fits' threshold).
    deep = [_ops_row("naive", 8, {"aten::alias": 1}), _ops_row("sdpa", 8, {})]
    assert op_diff(deep, "sdpa", "naive") == [
        {"region": "forward", "name": "aten::alias", "per_layer": -0.12, "one_depth": 8}
    ]


def test_op_diff_fits_both_labels_over_the_depths_both_measured() -> None:
    """A cell that failed leaves its depth out of both sides: counts that are the same at every
    shared depth differ by nothing, however they grow with depth (the foreach optimizer's
    kernels do not grow linearly). A difference that is not a straight line in n_layer says
    so; labels with no depth in common get no per-layer diff."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text, findings

    def row(variant: str, n: int, status: str = "ok") -> dict:
        chunks = {1: 3, 2: 3, 4: 4, 8: 7}[n]  # the same for both, not linear in n
        r = _ops_row(variant, n, {"aten::clone": n}, None)
        r["ops_per_step"]["optimizer"] = {"aten::_foreach_add_": chunks}
        return {**r, "status": status}

    rows = [row("naive", 1), row("naive", 2), row("naive", 8, "oom")]
    rows += [row("sdpa", n) for n in (1, 2, 8)]
    assert op_diff(rows, "sdpa", "naive") == []

    curved = [row("naive", n) for n in (1, 2, 4)] + [row("sdpa", n) for n in (1, 2, 4)]
    for r in curved:
        if r["variant"] == "sdpa":
            r["ops_per_step"]["forward"]["aten::clone"] = r["n_layer"] ** 2
    (diff,) = op_diff(curved, "sdpa", "naive")
    assert diff["name"] == "aten::clone" and diff["linear"] is False
    assert "(forward, on average: not the same at every depth)" in describe_diff(
        "sdpa", "naive", [diff]
    )
    for r in curved:
        if r["variant"] == "sdpa":
            r["ops_per_step"]["forward"]["aten::clone"] = 2 * r["n_layer"]
    assert op_diff(curved, "sdpa", "naive") == [
        {"region": "forward", "name": "aten::clone", "per_layer": 1.0}
    ]

    # Ops counted as one (kernels by their label) are summed before the fit: parts whose
    # split moves with depth, summing to a straight line, make a straight line.
    for r in curved:
        n, sdpa = r["n_layer"], r["variant"] == "sdpa"
        x, y = (n * n, 3 * n - n * n) if sdpa else (0, n)  # x + y: 3n against n
        r["ops_per_step"]["forward"] = {"aten::x": x, "aten::y": y}
    assert op_diff(curved, "sdpa", "naive", key_of=lambda name: "xy") == [
        {"region": "forward", "name": "xy", "per_layer": 2.0}
    ]

    apart = [row("naive", 1), row("naive", 2), row("sdpa", 4), row("sdpa", 8)]
    assert op_diff(apart, "sdpa", "naive") is None  # not [], which says they differ in nothing
    assert findings(apart) == ["- sdpa vs naive: not measured at a common n_layer, so no diff."]
    assert "not measured at a common n_layer" in diff_text(apart, "sdpa", "naive")


def test_diff_names_every_op_that_differs() -> None:
    """The report names a dozen, each region's largest in turn, and points to --diff; --diff
    shows them all, by region, views included, instead of the same cut list."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text

    extra = {f"aten::op{i:02d}": i for i in range(1, 16)}  # 15 named ops, more per layer in b
    rows = []
    for n in (1, 2):
        rows.append(_ops_row("a", n, {"aten::view": 3 * n}, {"aten::bmm": n}))
        rows.append(_ops_row("b", n, {k: v * n for k, v in extra.items()}))
    short = describe_diff("a", "b", op_diff(rows, "a", "b"))
    # Each region's largest in turn: the one backward difference is not crowded out.
    assert short.count(" fewer (forward)") == 11 and "1 aten::bmm more (backward)" in short
    assert "4 more differences (`profile_train.py --report" in short
    full = diff_text(rows, "a", "b")
    assert "more differences" not in full
    lines = full.splitlines()
    assert lines[0] == "a vs b, per layer per step, every op that differs:"
    forward, backward = lines.index("  forward:"), lines.index("  backward:")
    assert lines[forward + 1] == "    15 aten::op15 fewer"  # largest first
    assert all(f"    {i} aten::op{i:02d} fewer" in lines[forward:backward] for i in extra.values())
    assert "    3 aten::view more" in lines[forward:backward]
    assert lines[backward + 1 :] == ["    1 aten::bmm more"]


def test_kernel_labels_name_the_operation_and_its_dtype() -> None:
    """Kernel names as an H200 run recorded them (tests/cuda_kernel_names.json, each with the
    label read off by hand): a PyTorch launcher goes by the operation it runs and its dtype,
    other C++ kernels by their unqualified name, plain names unchanged."""
    from profiling.names import kernel_label

    names = json.loads((Path(__file__).parent / "cuda_kernel_names.json").read_text())
    assert len(names) >= 16
    for name, expected in names.items():
        assert kernel_label(name) == expected, name[:120]


def test_the_backend_check_knows_each_fused_kernel_by_its_recorded_name() -> None:
    """On a GPU the backend check also wants the backend's kernel in the trace: each pattern
    finds the kernel an H200 run recorded for its backend, and not another backend's."""
    names = json.loads((Path(__file__).parent / "cuda_kernel_names.json").read_text())
    kernels = {
        backend: next(name for name in names if marker in name)
        for backend, marker in [
            ("FLASH_ATTENTION", "pytorch_flash::flash_fwd_kernel"),
            ("EFFICIENT_ATTENTION", "fmha_cutlassF"),
            ("CUDNN_ATTENTION", "cudnn_generated_fort_native_sdpa"),
        ]
    }
    cuda = torch.device("cuda")  # a device type only: nothing runs
    for backend, kernel in kernels.items():
        ops = {"forward": {BACKEND_OPS[backend][0]: 1}}
        assert verify_backend(backend, ops, {"forward": {kernel: 1}}, cuda) is None, backend
        for other, elsewhere in kernels.items():
            if other != backend:
                problem = verify_backend(backend, ops, {"forward": {elsewhere: 1}}, cuda)
                said = "trace has no kernel whose name matches"
                assert problem and problem.startswith(said), (backend, other)


def test_renumbered_triton_kernels_are_no_difference() -> None:
    """Inductor numbers a graph's Triton kernels in order, so one fused kernel is `_13` in one
    variant's graph and `_8` in another's: the kernel diff counts them as the same kernel."""
    from profiling.findings import diff_text, findings

    def rows_with(kernels_of: dict[str, dict[str, int]]) -> list[dict]:
        rows = []
        for variant, kernels in kernels_of.items():
            for n in (1, 2):
                row = _ops_row(variant, n, {"aten::mm": n})
                row["kernels_per_step"] = {
                    "forward": {k: c * n for k, c in kernels.items()},
                    "backward": {},
                    "optimizer": {},
                }
                rows.append(row)
        return rows

    renumbered = rows_with(
        {
            "naive": {"triton_poi_fused_gelu_view_8": 2},
            "sdpa": {
                "triton_poi_fused_gelu_view_13": 2,
                "triton_per_fused__softmax_masked_fill_5": 1,
            },
        }
    )
    assert (
        "CUDA kernels: sdpa vs naive, per layer per step: 1 triton_per_fused__softmax_masked_fill "
        "more (forward)."
    ) in findings(renumbered)[1]
    assert "triton_poi_fused_gelu_view" not in diff_text(renumbered, "sdpa", "naive")


def _copy_kernel(vec: int, dtype: str = "c10::BFloat16") -> str:
    """A copy kernel's name as the profiler records it (shortened), launched `vec` wide."""
    return (
        f"void at::native::elementwise_kernel<128, {vec}, at::native::gpu_kernel_impl_nocast<"
        "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::"
        f"operator()() const::{{lambda()#12}}::operator()() const::{{lambda({dtype})#1}}>"
        "(at::TensorIteratorBase&)::{lambda(int)#1}>(int)"
    )


def test_kernel_findings_merge_launchers_of_one_operation() -> None:
    """One operation launched through two launchers (vectorized or not) is one label in the
    findings: counts add, a net zero drops out; --diff keeps every full name."""
    from profiling.analysis import describe_diff
    from profiling.findings import diff_text
    from profiling.names import kernel_label

    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    fill += "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
    rows = []
    for n in (1, 2):
        a = {_copy_kernel(2): 2 * n, "nvjet_x": n, _copy_kernel(2, "float"): n}
        b = {_copy_kernel(4): 1 * n, _copy_kernel(2): 3 * n, fill: n, _copy_kernel(4, "float"): n}
        for variant, kernels in (("a", a), ("b", b)):
            row = _ops_row(variant, n, {"aten::mm": n})
            row["kernels_per_step"] = {"forward": kernels, "backward": {}, "optimizer": {}}
            rows.append(row)
    kernels = op_diff(rows, "a", "b", kind="kernels_per_step", key_of=kernel_label)
    text = describe_diff("a", "b", kernels, unit="kernel")
    assert "2 direct_copy_kernel_cuda<BFloat16> fewer (forward)" in text
    assert "1 FillFunctor<float> fewer (forward)" in text and "1 nvjet_x more (forward)" in text
    assert "elementwise_kernel<128" not in text
    assert "direct_copy_kernel_cuda<float>" not in text  # a net zero
    full = diff_text(rows, "a", "b")
    assert (
        f"    1 {_copy_kernel(4)} fewer" in full.splitlines()
        and f"    1 {_copy_kernel(2)} fewer" in full
    )


def test_where_the_time_goes_on_cuda_lists_kernels_by_label() -> None:
    """On CUDA the largest kernels go by their labels, one operation's launchers summed; the
    unlisted rest ('other') counts in the total but is not a kernel to list."""
    from profiling.findings import where_time_goes

    kernels = {"other": 20.0, "nvjet_sm90_tst": 6.0, _copy_kernel(2): 5.0, _copy_kernel(4): 3.0}
    split = {"everything else": 1.0}
    row = split_row("sdpa", 40.0, {"aten::mm": 1.0}, device_ms_per_step=kernels, time_split=split)
    [line] = where_time_goes([row])
    assert (
        "Kernel time in the profiled step 34.0 ms" in line and "no kernel running +6.0 ms" in line
    )
    assert line.endswith(
        "Largest (ms): `direct_copy_kernel_cuda<BFloat16>` 8.0, `nvjet_sm90_tst` 6.0."
    )


def test_findings_compare_compiled_variants_with_compiled_naive() -> None:
    from profiling.findings import findings

    def row(variant: str, compiled: bool, n: int) -> dict:
        ops = {"naive": {"aten::bmm": 2 * n}, "sdpa": {"aten::_flash": n}}[variant]
        if compiled:
            ops = {**ops, "aten::mm": 3 * n}  # what compiling changes, shared by both
        return {
            "variant": variant,
            "compile": compiled,
            "n_layer": n,
            "status": "ok",
            "ops_per_step": {"forward": ops, "backward": {}, "optimizer": {}},
            "kernels_per_step": None,
        }

    rows = [row(v, c, n) for v in ("naive", "sdpa") for c in (False, True) for n in (1, 2)]
    lines = findings(rows)
    assert [line.split(",")[0] for line in lines] == [
        "- sdpa vs naive",
        "- sdpa+compile vs naive+compile",
    ]
    assert "aten::mm" not in lines[1], "what compiling changes cancels against compiled naive"


def test_a_variant_added_as_the_readme_shows_trains_and_is_profiled(
    data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's 'Adding a variant' example, as written: registered under a new name, it
    trains by --model.attention and is swept by --variants, its op diff against naive in the
    findings (the scale moves from the (T, T) scores to q; the in-place fill drops the copy)."""
    readme = (ROOT / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", readme, re.S) if "prescaled" in c)
    registry = dict(attention.VARIANTS)  # the example registers into this copy
    exec(code, {"F": F, "VARIANTS": registry, "Variant": attention.Variant})
    monkeypatch.setitem(attention.VARIANTS, "prescaled", registry["prescaled"])

    out = tmp_path / "run"
    argv = run_argv(data_root, out, "--model.attention=prescaled", "--train.max_steps=2")
    assert train.main(argv) == 0
    assert (out / CHECKPOINT).is_file()
    rc, results = sweep(tmp_path, "--variants", "naive,prescaled", "--layers", "1", "--no-traces")
    assert rc == 0
    assert [(r["variant"], r["status"]) for r in results["rows"]] == [
        ("naive", "ok"),
        ("prescaled", "ok"),
    ]
    report = (tmp_path / "sweep" / "report.md").read_text()
    findings = report.split("## Findings")[1].split("##")[0]
    assert "1 aten::clone fewer (forward); 1 aten::copy_ fewer (forward)" in findings, findings


def test_findings_skip_a_variant_whose_baseline_failed() -> None:
    from profiling.findings import findings

    rows = [_ops_row(v, n, {"aten::mm": 4.0 * n}) for v in ("naive", "sdpa") for n in (1, 2)]
    for row in rows[:2]:
        row["status"] = "failed"
    assert findings(rows) == []


def test_time_split_of_old_categories_is_recomputed_from_the_listed_ops() -> None:
    from profiling.findings import _split_ms
    from profiling.names import CATEGORIES

    row = {
        "cpu_ms_per_step": {"aten::mm": 3.0, "aten::add": 1.0},
        "time_split": {"matmul": 0.75, "rest": 0.25},
    }  # a results.json's older categories
    split, listed_only = _split_ms(row)
    assert listed_only
    assert set(split) <= set(CATEGORIES)
    assert sum(split.values()) == pytest.approx(4.0)


def test_backend_check_counts_unattributed_cuda_kernels() -> None:
    from profiling.measure import backend_problem

    row = {
        "ops_per_step": {
            "forward": {"aten::_scaled_dot_product_flash_attention": 2.0},
            "backward": {},
            "optimizer": {},
        },
        "kernels_per_step": {"forward": {}, "backward": {}, "optimizer": {}},
        "kernels_unattributed_per_step": {"void pytorch_flash::flash_fwd_kernel<...>": 2.0},
    }
    assert backend_problem("sdpa-flash", row, torch.device("cuda")) is None
