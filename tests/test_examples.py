"""The examples run: examples/train_text.py at a tiny size on the CPU.

The training run is compiled with the "aot_eager" backend (Dynamo + AOTAutograd, no code generation): it
checks that "mok" and "grouped_mm" capture fullgraph, forward and backward, without the minutes of C++
compilation Inductor would add on a 2-core machine. The Inductor path of the same model is what
tests/test_transformers.py compiles.
"""

import importlib.util
import json
import math
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_text():
    if "train_text" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_text", os.path.join(REPO, "examples", "train_text.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_text"] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)
    return sys.modules["train_text"]


def test_corpus_holds_out_whole_files(tmp_path):
    """The split is by file, deterministic (sorted paths, every 20th held out), installed packages left out."""
    ex = _train_text()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    names = [f"pkg{i % 3}/m{i:03d}.py" for i in range(45)]
    texts = {}
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        texts[name] = bytes(torch.randint(32, 127, (int(torch.randint(5, 40, (), generator=g)),), generator=g).tolist())
        path.write_bytes(texts[name])
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_bytes(b"not part of the corpus")
    (tmp_path / "notes.txt").write_bytes(b"not python")

    corpus = ex.load_corpus(str(tmp_path))
    order = sorted(names)
    val = [n for i, n in enumerate(order) if i % ex.VAL_EVERY_NTH_FILE == 0]
    train = [n for n in order if n not in val]
    assert (corpus.train_files, corpus.val_files) == (len(train), len(val))
    assert bytes(corpus.val.tolist()) == b"".join(texts[n] + b"\n" for n in val)
    assert bytes(corpus.train.tolist()) == b"".join(texts[n] + b"\n" for n in train)


def test_train_text_learns_and_mok_tracks_grouped_mm(tmp_path):
    """A few steps of each backend on the standard library's bytes: every curve is finite and falls from
    about ln 256; "mok" follows "grouped_mm" step by step to float32 rounding and the
    verdict puts them within the seed-to-seed noise; the PNG and the JSON are written."""
    ex = _train_text()
    steps = 10
    rec = ex.main(["--preset", "tiny", "--layers", "1", "--steps", str(steps), "--batch", "4", "--seq", "64",
                   "--eval-every", "5", "--compile", "aot_eager", "--seeds", "0,1", "--device", "cpu",
                   "--backends", "mok,grouped_mm", "--out", str(tmp_path)])  # (HF's eager loop: the slowest compile)
    runs = {(r["backend"], r["seed"]): r for r in rec["results"]}
    assert set(runs) == {("mok", 0), ("grouped_mm", 0), ("grouped_mm", 1)}
    for (backend, seed), r in runs.items():
        assert len(r["losses"]) == steps and all(math.isfinite(v) for v in r["losses"]), (backend, seed)
        assert [s for s, _ in r["val"]] == [0, 5, 10] and all(math.isfinite(v) for _, v in r["val"])
        # a random init predicts near-uniform bytes: the first loss is about ln 256
        assert abs(r["losses"][0] - math.log(256)) < 0.3, (backend, r["losses"][0])
        assert sum(r["losses"][-3:]) / 3 < r["losses"][0] - 0.5, (backend, seed, r["losses"])
        assert r["val"][-1][1] < r["val"][0][1] - 0.5, (backend, seed, r["val"])
        assert r["compiled"] and r["fullgraph"], r
        assert r["tokens_per_s"] > 0

    # Same weights, same batches: the backends differ by float32 rounding only (measured: at most one ulp of
    # the loss over these steps). The bound is tight because at a random init the experts' output is small
    # against the residual stream: an expert computation 30% off moves the loss by ~4e-6 relative at the first
    # step and ~1e-4 after one update, so a loose bound would pass a wrong backend.
    base = runs[("grouped_mm", 0)]["losses"]
    for backend in ("mok",):
        got = runs[(backend, 0)]["losses"]
        worst = max(abs(a - b) / b for a, b in zip(got, base))
        assert worst <= 5e-6, (backend, worst, got, base)
    assert runs[("grouped_mm", 1)]["losses"][0] != base[0]  # the second seed is a different run

    v = rec["verdict"]
    assert v["baseline"] == "grouped_mm" and v["noise_seeds"] == [0, 1] and v["noise"] > 0
    assert v["backends"]["mok"]["within_noise"], v

    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["verdict"] == v
