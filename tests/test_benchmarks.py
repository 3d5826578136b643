"""benchmarks/profile_moe.py's GEMM accounting and its CPU smoke run, bench_moe.py's --check (every contender
against mok) and its interleaved rounds driven on the CPU with a stand-in timer, generate_hf.py's CPU smoke run
(the figures themselves come from GPU runs)."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import bench_moe  # noqa: E402
import profile_moe  # noqa: E402


def test_gemm_units_add_up_to_the_layer_flops():
    # the kernel families' GEMMs: forward 6 N H I FLOPs (gate/up 4, down 2), backward 12 (dh 2, dx 4, weight
    # gradients 6), as mok_inductor.kernels' docstring counts them
    assert sum(profile_moe.GEMM_UNITS["fwd"].values()) * 2 == 6
    assert sum(profile_moe.GEMM_UNITS["fwd+bwd"].values()) * 2 == 18
    shape = (8, 64, 32, 4, 2)  # T, H, I, E, K: N = 16 routes
    # the gate/up GEMM, 2 * 16 * 64 * 64 FLOPs in 1 ms
    assert abs(profile_moe.gemm_tflops("_gate_up_kernel_0d1d", 1.0, shape, "fwd") - 2 * 16 * 64 * 64 / 1e9) < 1e-15
    assert profile_moe.gemm_tflops("_combine_kernel", 1.0, shape, "fwd") is None
    assert profile_moe.gemm_tflops("_wgrad_body", 1.0, shape, "fwd") is None  # no weight gradient in a forward


def test_cpu_smoke_run_with_gemm_references(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", "profile_moe.py"), "--device", "cpu",
                          "--shapes", "tiny", "--iters", "2", "--gemm-refs", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.load(open(tmp_path / "profile.json"))["results"][0]
    # (the row-kernel stage: the Triton interpreter runs it here, TRITON_INTERPRET being set for the tests)
    assert set(res["gemm_refs"]) == {"gate/up", "down", "dh", "dx", "wgrad down", "wgrad gate/up",
                                     "dense mm (gate/up FLOPs)", profile_moe.ROW_KERNEL_STAGE}
    assert all(ms > 0 and rate > 0 for ms, rate in res["gemm_refs"].values())
    assert res["kernels"] and all("tflops" in r for r in res["kernels"])


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_generate_cpu_smoke_run(tmp_path, static):
    # both backends in their own processes, with transformers' default dynamic KV cache or a static one (on a GPU
    # transformers compiles the decoding forward then; here it stays eager): the cache class generate() used,
    # every length timed in every pass (the warm one: the median of --warm-passes, the lower of two), the same
    # weights in both processes, the mok process's prefill and decode calls ran mok (greedy tokens are compared,
    # not required equal: bf16)
    run = subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", "generate_hf.py"), "--device", "cpu",
                          "--tiny", "--lengths", "5,9", "--max-new-tokens", "3", "--warmup-len", "4",
                          "--warm-passes", "2", "--out", str(tmp_path)] + (["--static-cache"] if static else []),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.load(open(tmp_path / "generate_hf.json"))
    assert res["meta"]["static_cache"] is static
    rows = {r["backend"]: r for r in res["results"]}
    assert set(rows) == {"mok", "grouped_mm"} and not any("error" in r for r in rows.values())
    for r in rows.values():
        assert r["cache_class"] == ("StaticCache" if static else "DynamicCache")
        assert set(r["cold"]["per_length_s"]) == set(r["warm"]["per_length_s"]) == {"5", "9"}
        assert len(r["warm"]["passes_total_s"]) == 2 and r["warm"]["total_s"] == min(r["warm"]["passes_total_s"])
        assert all(len(t) == 3 for t in r["tokens"].values())
        assert r["same_tokens_cold_warm"]
    assert rows["grouped_mm"]["same_weights_as_first"]
    assert rows["mok"]["mok_plans"] == ["supported"]
    assert set(rows["mok"]["impl_calls"]) == {"prefill:mok", "decode:mok"}
    assert set(rows["grouped_mm"]["agreement"]) == {"5", "9"}


def _check_run(script):
    """stdout of `benchmarks/<script> --check` (its CPU smoke run), which must exit 0."""
    run = subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", script), "--check"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def test_bench_moe_check_every_contender_runs_and_agrees():
    # --check: each contender (mok eager, compiled static and dynamic, pointer loads, MXFP8, grouped_mm eager and
    # compiled, the HF loop) at a tiny shape against mok's output, and its fwd+bwd finite; exit 0 only if all pass
    out = _check_run("bench_moe.py")
    for c in ("mok_compiled", "mok_compiled_dynamic", "grouped_mm_compiled", "mok_mxfp8"):
        assert any(line.split(":")[0].strip() == c and line.endswith("ok") for line in out.splitlines()), c


def test_bench_decode_check_contenders_agree():
    # --check: mok's decode forward, mok's grouped kernels and torch._grouped_mm at a tiny decode shape, under the
    # interpreter, each against a float64 loop, mok through the decode forward; exit 0 only if all agree
    out = _check_run("bench_decode.py")
    assert [line.split(":")[0] for line in out.splitlines() if line.endswith(" ok")] == [
        "mok", "mok_grouped", "grouped_mm"], out
    assert "mok: " in out and out.split("mok: ")[1].split("\n")[0].endswith("decode forward ran ok"), out


def test_interleaved_rounds_cover_every_mode_and_routing(monkeypatch):
    # the rounds mode on the CPU (mok's reference, grouped_mm's torch ops), a stand-in timer: the contenders
    # alternate within each round (mok 2 ms, the baseline 3 ms), every (shape, routing, mode) gets its rounds
    # with inputs of its routing, a forward step returns y and a fwd+bwd step the four gradients, the results
    # so far are handed on after each entry, and a ratio is the baseline's time over the contender's
    monkeypatch.setitem(bench_moe.SHAPES, "tiny", (16, 32, 16, 4, 2))
    kinds, calls, saved = [], [], []
    make_inputs = bench_moe.make_inputs

    def recording_inputs(T, H, I, E, K, kind, **kw):
        kinds.append(kind)
        return make_inputs(T, H, I, E, K, kind, **kw)

    monkeypatch.setattr(bench_moe, "make_inputs", recording_inputs)

    def timer(step, iters):
        out = step()
        calls.append(out)
        return (2.0 if len(calls) % 2 else 3.0), iters

    plan = [("tiny", "balanced"), ("tiny", "skewed")]
    out = bench_moe.interleaved(plan, ["mok", "grouped_mm"], 2, 5, lambda line: None, modes=("fwd", "fwd+bwd"),
                                device="cpu", timer=timer, on_result=lambda res: saved.append(len(res)))
    assert kinds == ["balanced", "skewed"]
    assert [(r["shape"], r["routing"], r["mode"]) for r in out] == [
        ("tiny", "balanced", "fwd"), ("tiny", "balanced", "fwd+bwd"), ("tiny", "skewed", "fwd"),
        ("tiny", "skewed", "fwd+bwd")]
    assert saved == [1, 2, 3, 4]
    assert len(calls) == 4 * 2 * 2  # entries x rounds x contenders
    for i, got in enumerate(calls):  # each entry's 4 timings, fwd entries first within a shape
        if (i // 4) % 2 == 0:
            assert isinstance(got, torch.Tensor) and got.shape == (16, 32) and not got.requires_grad
        else:
            assert isinstance(got, tuple) and len(got) == 4 and all(g.isfinite().all() for g in got)
    for r in out:
        assert r["base"] == "grouped_mm" and len(r["rounds"]) == 2
        assert r["median_ms"] == {"mok": 2.0, "grouped_mm": 3.0}
        assert r["mok"] == {"median_ratio": 1.5, "min_ratio": 1.5, "max_ratio": 1.5}
    with pytest.raises(ValueError, match=r"got fwd\+bw$"):  # a misspelt mode is an error, not a silent forward
        bench_moe.interleaved(plan, ["mok", "grouped_mm"], 1, 1, lambda line: None, modes=("fwd+bw",), device="cpu",
                              timer=timer)


def test_dynamic_compiled_contender_runs_two_token_counts_in_one_graph():
    # mok_compiled_dynamic: torch.compile(dynamic=True), one graph for every token count (T = 8 and 24 here;
    # Dynamo specialises 0 and 1 only), the outputs equal to eager mok's
    import mok_inductor
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with mok_inductor.enabled():  # (restored after: other tests check the process's passes)
        for T in (8, 24):
            x, rw, te, w_gu, w_d = bench_moe.make_inputs(T, 32, 16, 4, 2, "balanced", device="cpu")
            with torch.no_grad():
                want = bench_moe.moe_mok(x, rw, te, w_gu, w_d)
                got = bench_moe.moe_mok_compiled_dynamic(x, rw, te, w_gu, w_d)
            assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
