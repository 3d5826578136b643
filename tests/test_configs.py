"""Tile-config tables (mok_inductor/kernels/configs.py) and the tuning command (mok_inductor/tune.py), on CPU:
bucketing, the table format and its validation at load, the lookup order (user table, this GPU's shipped
table, a table of the same compute capability, the nearest problem, the family's default), the run-time
search's plumbing (every candidate timed on scratch outputs, the fastest recorded and read back by a later
process), and the tuner's plumbing. The kernels under the interpreter run one config (`Family.interpret`);
the search's kernel launches here run that interpreter on a toy kernel."""

import json
import math

import pytest
import torch
import triton
import triton.language as tl

import mok_inductor
from mok_inductor import kernels, options, tune
from mok_inductor.kernels import configs
from mok_inductor.kernels.configs import Tile

H100 = ("NVIDIA H100 80GB HBM3", "9.0")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (the toy kernel's tensors: the interpreter's on CPU)
GATE_UP = kernels.gate_up.GATE_UP


def _problem(H=2048, I=768, E=128, tma=True, dtype="bfloat16", mx=False):
    return (dtype, H, I, E, tma, mx)


def _table(device, capability, entries):
    """A table JSON object: entries = [(family, problem tuple, {bucket: Tile})]."""
    t = configs.Table(device, capability)
    for fam, prob, per in entries:
        for b, tile in per.items():
            t.put(fam, prob, b, tile)
    return t.to_json()


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """(user folder, shipped folder), both empty, in effect for the test; picks forgotten before and after."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setattr(configs, "SHIPPED_DIR", shipped)
    configs.reset()
    with options.override(tables_dir=str(user), autotune=False):
        yield user, shipped
    configs.reset()


def test_bucket_is_the_next_power_of_two():
    assert [configs.bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025, 4097 * 8)] == \
        [1, 1, 2, 4, 4, 8, 1024, 1024, 2048, 65536]


def test_table_name_of_gpu_names():
    assert configs.table_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert configs.table_name("NVIDIA H200") == "nvidia-h200"


def test_every_family_is_registered_with_valid_candidates():
    names = {"gate_up", "gate_up_mx", "grouped_rows", "grouped_rows_mx", "bwd_act", "bwd_gemm", "wgrad",
             "gate_up_stage"}
    assert set(configs.FAMILIES) == names
    for fam in configs.FAMILIES.values():
        assert len(set(fam.candidates)) == len(fam.candidates) > 1
        assert fam.fields[0] == "dtype" and "E" in fam.sizes
        if fam.is_stage:
            assert fam.interpret == fam.candidates[0] and all(t.name for t in fam.candidates) and not fam.outputs
            continue
        assert all(math.log2(v).is_integer() for t in fam.candidates for v in (t.block_m, t.block_n, t.block_k))
        assert all(n in fam.arg_names for n in fam.outputs)
        assert not any(t.name for t in fam.candidates)


def test_stage_picks_round_trip_and_answer_only_their_own_problem(tables, tmp_path):
    # a stage family's picks are names in the file; a problem without its own picks runs the fused way (a stage
    # measured faster at one shape says nothing of a shape near it), and a name the stage does not know is an error
    user, shipped = tables
    fam = configs.FAMILIES["gate_up_stage"]
    fused, gmm = fam.candidates
    mixtral = ("bfloat16", 4096, 14336, 8)
    picks = [("gate_up_stage", mixtral, {4096: gmm, 64: fused})]
    path = _write(shipped / "nvidia-h100-80gb-hbm3.json", _table(*H100, picks))
    assert '"4096": "grouped_mm"' in configs.dumps(configs.load(path))
    assert configs.load(path).get("gate_up_stage", mixtral) == {4096: gmm, 64: fused}
    state = configs.tables_for(*H100)
    assert configs.lookup(state, fam, mixtral, 4000) == (gmm, "table")
    assert configs.lookup(state, fam, mixtral, 64) == (fused, "table")
    # another bucket of the problem, or another problem: the fused way (no nearest bucket or problem)
    assert configs.lookup(state, fam, mixtral, 8192) == (fused, "default")
    assert configs.lookup(state, fam, ("bfloat16", 4096, 14336, 16), 4096) == (fused, "default")
    bad = json.loads(path.read_text())
    bad["families"]["gate_up_stage"][0]["configs"]["64"] = "cublas"
    with pytest.raises(configs.TableError, match="not a way the gate_up_stage stage runs"):
        configs.parse(bad)
    bad["families"]["gate_up_stage"][0]["configs"]["64"] = [128, 128, 64, 8, 3]
    with pytest.raises(configs.TableError, match="not a way"):
        configs.parse(bad)
    tile = json.loads(path.read_text())
    tile["families"]["gate_up"] = [{"problem": dict(zip(GATE_UP.fields, _problem())), "configs": {"64": "grouped_mm"}}]
    with pytest.raises(configs.TableError, match="a config is"):
        configs.parse(tile)


def test_stage_search_times_each_way_that_can_run_and_records_the_fastest(tables, monkeypatch):
    user, _ = tables
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    fam = configs.FAMILIES["gate_up_stage"]
    prob = ("bfloat16", 4096, 14336, 8)
    timed, ran = [], []

    def timer(run, tile):
        timed.append(tile.name)
        run()
        return {"fused": 2.0, "grouped_mm": 1.0}[tile.name]

    monkeypatch.setattr(configs, "default_timer", timer)
    asked = []

    def way(name, can_run=True):
        def runner():
            ran.append(name)
            return name[0]
        return lambda: asked.append(name) or (runner if can_run else None)

    ways = {"fused": way("fused"), "grouped_mm": way("grouped_mm")}
    cannot = {"fused": way("fused"), "grouped_mm": way("grouped_mm", can_run=False)}
    cpu = torch.device("cpu")
    assert kernels.common.run_stage(fam, prob, 5000, cpu, ways) == "f"  # no search: the default, the fused way
    assert asked == ["fused"]  # (the other way's conditions not even asked)
    with options.override(autotune=True):
        assert kernels.common.run_stage(fam, prob, 5000, cpu, ways) == "g"
        assert timed == ["fused", "grouped_mm"] and ran == ["fused", "fused", "grouped_mm", "grouped_mm"]
        assert kernels.common.run_stage(fam, prob, 6000, cpu, ways) == "g" and len(timed) == 2  # searched bucket
        # where one way alone can run, nothing is timed or recorded (a later call that can run both searches)
        assert kernels.common.run_stage(fam, prob, 100, cpu, cannot) == "f"
        assert len(timed) == 2
        assert kernels.common.run_stage(fam, prob, 100, cpu, ways) == "g" and len(timed) == 4
    assert configs.load(user / "nvidia-h100-80gb-hbm3.json").get("gate_up_stage", prob) == \
        {8192: fam.candidates[1], 128: fam.candidates[1]}
    configs.reset()
    assert kernels.common.run_stage(fam, prob, 8000, cpu, cannot) == "f"
    assert kernels.common.run_stage(fam, prob, 8000, cpu, ways) == "g"  # a later process reads the pick

    def failing():
        raise RuntimeError("grouped gemm: unsupported layout")

    # a way that fails while searched: a warning, the fused way kept for this process, nothing written
    with options.override(autotune=True):
        with pytest.warns(RuntimeWarning, match="'grouped_mm' way failed at 30 rows.*unsupported layout"):
            assert kernels.common.run_stage(fam, prob, 30, cpu, {**ways, "grouped_mm": lambda: failing}) == "f"
        assert configs.tables_for(*H100).picks[("gate_up_stage", prob, 32)] == fam.candidates[0]
        assert kernels.common.run_stage(fam, prob, 31, cpu, ways) == "f"  # (searched in this process)
        assert 32 not in configs.load(user / "nvidia-h100-80gb-hbm3.json").get("gate_up_stage", prob)
        with pytest.raises(RuntimeError, match="unsupported"):  # the fused way's errors are the caller's
            kernels.common.run_stage(fam, prob, 3, cpu, {**ways, "fused": lambda: failing})


def test_table_round_trip(tmp_path):
    fam = configs.FAMILIES["grouped_rows"]
    prob = ("bfloat16", 2048, 768, 128, False, True, True, False)
    per = {1: fam.candidates[3], 64: fam.candidates[1], 65536: fam.candidates[0]}
    path = tmp_path / "t.json"
    t = configs.Table("NVIDIA H100 80GB HBM3", "9.0")
    for b, tile in per.items():
        t.put("grouped_rows", prob, b, tile)
    configs.save(t, path)
    lines = {line.strip().rstrip(",") for line in path.read_text().splitlines()}
    assert all(f'"{b}": {json.dumps(tile.as_list())}' in lines for b, tile in per.items())  # a pick a line
    raw = json.loads(path.read_text())
    assert raw["format"] == configs.FORMAT and raw["device"] == "NVIDIA H100 80GB HBM3"
    entry = raw["families"]["grouped_rows"][0]
    assert entry["problem"] == dict(zip(fam.fields[:-1], prob[:-1]))  # MX left out at its default (false)
    back = configs.load(path)
    assert back.get("grouped_rows", prob) == per and back.capability == "9.0"
    mx = prob[:-1] + (True,)  # written where true
    t.put("grouped_rows", mx, 64, fam.candidates[2])
    configs.save(t, path)
    assert {"MX": True}.items() <= json.loads(path.read_text())["families"]["grouped_rows"][1]["problem"].items()
    assert configs.load(path).get("grouped_rows", mx) == {64: fam.candidates[2]}


def _valid():
    fam = GATE_UP
    return {"format": configs.FORMAT, "device": "X", "capability": "9.0",
            "families": {"gate_up": [{"problem": dict(zip(fam.fields, _problem())),
                                      "configs": {"64": fam.candidates[0].as_list()}}]}}


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d.update(format="other/1"), "not a tile-config table"),
    (lambda d: d["families"].update(nope=[]), "unknown kernel family 'nope'"),
    (lambda d: d["families"]["gate_up"][0]["problem"].pop("TMA"), "exactly the fields"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(H=-1), "size 'H'"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(dtype="bfloat17"), "not one the kernels take"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(dtype="half"), "not one the kernels take"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(dtype="int32"), "not one the kernels take"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(E=0), "size 'E' must be a positive int"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(TMA=7), "flag 'TMA' must be true or false"),
    (lambda d: d["families"]["gate_up"][0]["problem"].update(MX=1), "flag 'MX' must be true or false"),
    (lambda d: d["families"].update(gate_up_mx=[{"problem": {"dtype": "bfloat16", "H": 64, "I": 32, "E": 4,
                                                             "MX_LOOP": 0}, "configs": {"8": [8, 32, 256, 2, 3]}}]),
     "MX_LOOP must be one of"),
    (lambda d: d["families"]["gate_up"].append(d["families"]["gate_up"][0]), "has an earlier entry"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"064": [128, 128, 64, 8, 3]}), "not a power of two"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"\u0664": [128, 128, 64, 8, 3]}), "not a power of two"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"\u00b2": [128, 128, 64, 8, 3]}), "not a power of two"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"48": [128, 128, 64, 8, 3]}), "not a power of two"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"64": [128, 128, 64, 8]}), "a config is"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"64": [128, 128, 64, 8, 7]}),
     "not a config the gate_up kernel takes"),
    (lambda d: d["families"]["gate_up"][0]["configs"].update({"64": [256, 256, 256, 8, 3]}),
     "not a config the gate_up kernel takes"),
])
def test_a_bad_table_is_an_error_at_load(tmp_path, breakage, message):
    data = _valid()
    configs.parse(data)  # the unbroken one loads
    breakage(data)
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(configs.TableError, match=message) as e:
        configs.load(path)
    assert str(path) in str(e.value)


def test_a_bad_table_in_the_user_folder_fails_the_launch_not_silently(tables):
    user, _ = tables
    data = _valid()
    data["families"]["gate_up"][0]["configs"]["64"] = [16, 16, 16, 1, 1]
    _write(user / "nvidia-h100-80gb-hbm3.json", data)
    with pytest.raises(configs.TableError, match="not a config the gate_up kernel takes"):
        configs.tables_for(*H100)


def test_not_json_is_an_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{")
    with pytest.raises(configs.TableError, match="not valid JSON"):
        configs.load(path)
    path.write_bytes(b'{"format": "\xff"}')  # not UTF-8
    with pytest.raises(configs.TableError, match=f"{path}: not valid JSON text"):
        configs.load(path)


def test_a_key_twice_in_one_object_is_an_error(tmp_path):
    text = json.dumps(_valid()).replace('"64": [', '"64": [128, 128, 64, 8, 3], "64": [', 1)
    path = tmp_path / "dup.json"
    path.write_text(text)
    with pytest.raises(configs.TableError, match=f"{path}: the key '64' appears twice"):
        configs.load(path)


def test_a_table_without_the_mx_flag_reads_as_bf16_weights(tmp_path):
    # tables written before the MX field: their problems are the bf16 weights' (MX false), not an error
    data = _valid()
    del data["families"]["gate_up"][0]["problem"]["MX"]
    got = configs.parse(data)
    assert got.get("gate_up", _problem()) == {64: GATE_UP.candidates[0]}
    assert configs.parse(_valid()).entries == got.entries


def test_lookup_exact_bucket_then_nearest_bucket(tables):
    user, _ = tables
    c = GATE_UP.candidates
    _write(user / "nvidia-h100-80gb-hbm3.json",
           _table(*H100, [("gate_up", _problem(), {8: c[5], 1024: c[2], 65536: c[0]})]))
    state = configs.tables_for(*H100)
    assert configs.lookup(state, GATE_UP, _problem(), 8) == (c[5], "table")
    assert configs.lookup(state, GATE_UP, _problem(), 5) == (c[5], "table")  # bucket 8
    assert configs.lookup(state, GATE_UP, _problem(), 1000) == (c[2], "table")
    assert configs.lookup(state, GATE_UP, _problem(), 1) == (c[5], "table")  # nearest: 8
    assert configs.lookup(state, GATE_UP, _problem(), 2 ** 20)[0] == c[0]
    assert configs.lookup(state, GATE_UP, _problem(), 4096)[0] == c[2]  # 2 octaves from 1024, 4 from 65536


def test_lookup_tie_prefers_the_larger_bucket(tables):
    user, _ = tables
    c = GATE_UP.candidates
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", _problem(), {1024: c[2], 65536: c[0]})]))
    state = configs.tables_for(*H100)
    assert configs.lookup(state, GATE_UP, _problem(), 8192)[0] == c[0]


def test_lookup_nearest_problem_same_flags_and_rows_per_expert(tables):
    user, _ = tables
    c = GATE_UP.candidates
    near = _problem(H=4096, I=1536, E=128)  # one octave off in H and I
    far = _problem(H=7168, I=2048, E=32)
    other_flag = _problem(H=2048, I=768, E=128, tma=False)  # the same sizes, another kernel variant
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [
        ("gate_up", near, {64: c[3], 1024: c[1]}),
        ("gate_up", far, {64: c[4]}),
        ("gate_up", other_flag, {64: c[5], 1024: c[5]}),
    ]))
    state = configs.tables_for(*H100)
    assert configs.lookup(state, GATE_UP, _problem(H=3072, I=1024), 1024) == (c[1], "nearest")
    assert configs.lookup(state, GATE_UP, _problem(H=3072, I=1024), 64)[0] == c[3]
    # 64 experts with 512 rows: 8 rows per expert, as the E=128 entry's bucket 1024 (and not its bucket 512)
    assert configs.lookup(state, GATE_UP, _problem(H=4096, I=1536, E=64), 512)[0] == c[1]
    assert configs.lookup(state, GATE_UP, _problem(H=4096, I=1536, E=64), 32)[0] == c[3]
    # float32 has no neighbour: the default; float16 takes bfloat16's problem (the same tiles fit)
    assert configs.lookup(state, GATE_UP, _problem(dtype="float32"), 64) == (GATE_UP.candidates[0], "default")
    assert configs.lookup(state, GATE_UP, _problem(H=4096, I=1536, dtype="float16"), 1024) == (c[1], "nearest")
    # MXFP8 weights read in the K loop, with no pick of their own: their bf16 twin's
    assert configs.lookup(state, GATE_UP, _problem(H=4096, I=1536, mx=True), 1024) == (c[1], "table")


def test_defaults_without_tables(tables):
    state = configs.tables_for(*H100)
    mx = configs.FAMILIES["gate_up_mx"]
    few = options.current().mx_few_rows
    prob = ("bfloat16", 2048, 768, 128, 2)
    assert configs.lookup(state, mx, prob, few * 128) == (mx.small, "default")
    assert configs.lookup(state, mx, prob, few * 128 + 1) == (mx.candidates[0], "default")
    # by bucket: at 96 experts the bound few * 96 falls inside a bucket, whose rows all get one config
    assert configs.lookup(state, mx, ("bfloat16", 2048, 768, 96, 2), few * 96 - 8)[0] == mx.candidates[0]
    with options.override(mx_few_rows=2 * few):
        assert configs.lookup(configs.tables_for(*H100), mx, prob, few * 128 + 1)[0] == mx.small
    assert configs.lookup(state, GATE_UP, _problem(), 1) == (GATE_UP.candidates[0], "default")


def test_user_table_before_shipped_by_name_then_capability(tables):
    user, shipped = tables
    c = GATE_UP.candidates
    p = _problem()
    _write(shipped / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", p, {64: c[1]})]))
    _write(shipped / "nvidia-h200.json", _table("NVIDIA H200", "9.0", [("gate_up", p, {64: c[2]})]))
    _write(shipped / "nvidia-a100.json", _table("NVIDIA A100-SXM4-80GB", "8.0", [("gate_up", p, {64: c[4]})]))
    assert configs.lookup(configs.tables_for(*H100), GATE_UP, p, 64)[0] == c[1]
    assert configs.lookup(configs.tables_for("NVIDIA H200", "9.0"), GATE_UP, p, 64)[0] == c[2]
    # a GPU without a table of its own: the same compute capability's, the most alike by name first
    assert configs.lookup(configs.tables_for("NVIDIA H100 PCIe", "9.0"), GATE_UP, p, 64)[0] == c[1]
    assert configs.lookup(configs.tables_for("NVIDIA H200 NVL", "9.0"), GATE_UP, p, 64)[0] == c[2]
    assert configs.lookup(configs.tables_for("NVIDIA A100 80GB PCIe", "8.0"), GATE_UP, p, 64)[0] == c[4]
    assert configs.lookup(configs.tables_for("Some GPU", "12.0"), GATE_UP, p, 64)[1] == "default"
    # a problem only the other sm_90 GPU's table holds: its exact entry, not the nearest problem of this GPU's
    q = _problem(E=64)
    _write(shipped / "nvidia-h200.json", _table("NVIDIA H200", "9.0", [("gate_up", p, {64: c[2]}),
                                                                        ("gate_up", q, {64: c[5]})]))
    configs.reset()
    assert configs.lookup(configs.tables_for(*H100), GATE_UP, q, 64) == (c[5], "table")
    assert configs.lookup(configs.tables_for(*H100), GATE_UP, p, 64)[0] == c[1]  # its own name first
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", p, {64: c[3]})]))
    configs.reset()
    assert configs.lookup(configs.tables_for(*H100), GATE_UP, p, 64)[0] == c[3]  # the user's first
    with options.override(autotune=True):
        # searching or not, a launch that cannot search (compiled) reads the shipped tables too
        state = configs.tables_for(*H100)
        assert [t.source for t in state.chain()][0] == str(user / "nvidia-h100-80gb-hbm3.json")
        assert configs.lookup(state, GATE_UP, q, 64) == (c[5], "table")


def test_an_mxfp8_launch_takes_its_bf16_twin_where_it_has_no_bucket(tables):
    # the MXFP8 K-loop problem's own buckets win; elsewhere its bf16 twin's picks, not its one tuned bucket's
    user, _ = tables
    c = GATE_UP.candidates
    p, mx = _problem(tma=False), _problem(tma=False, mx=True)
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", p, {256: c[1], 2048: c[2], 16384: c[3]}),
                                                                ("gate_up", mx, {16384: c[4]})]))
    state = configs.tables_for(*H100)
    assert configs.lookup(state, GATE_UP, mx, 16384) == (c[4], "table")
    assert configs.lookup(state, GATE_UP, mx, 2048) == (c[2], "table")
    assert configs.lookup(state, GATE_UP, mx, 300)[0] == c[1]
    assert configs.lookup(state, GATE_UP, p, 16384)[0] == c[3]  # the twin keeps its own
    # an MXFP8 problem alone (no twin tabled) is a table of its own
    assert configs.lookup(state, GATE_UP, _problem(E=64, tma=False, mx=True), 300)[1] == "nearest"


def test_a_compiled_launchs_table_pick_does_not_stop_the_eager_search(tables, monkeypatch):
    # under autotune, a traced launch takes a table pick (memoised by `pick`) without searching: the first eager
    # launch of that (problem, bucket) must still search, and once recorded it does not search again
    c = GATE_UP.candidates
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    cpu = torch.device("cpu")
    with options.override(autotune=True):
        state = configs.tables_for(*H100)
        state.user.put("gate_up", _problem(), 512, c[1])  # a bucket nearby: the traced launch's pick
        assert configs.pick(GATE_UP, _problem(), 64, cpu) == c[1]
        assert ("gate_up", _problem(), 64) in state.picks
        assert configs.needs_search(GATE_UP, _problem(), 64, cpu) is state
        configs.record(state, GATE_UP, _problem(), 64, c[2])
        assert configs.needs_search(GATE_UP, _problem(), 64, cpu) is None
        assert configs.pick(GATE_UP, _problem(), 64, cpu) == c[2]


def _record_in_a_process(args):
    folder, worker, n = args
    from mok_inductor import options as opts
    from mok_inductor.kernels import configs as cf

    with opts.override(tables_dir=folder, autotune=True):
        state = cf.tables_for(*H100)
        fam = cf.FAMILIES["gate_up"]
        for i in range(n):
            cf.record(state, fam, _problem(E=2 + worker), 1 << i, fam.candidates[i % len(fam.candidates)])


def test_searching_processes_side_by_side_keep_each_others_picks(tmp_path):
    # four processes record picks into one user table at once: every pick is in the file at the end (the file's
    # read-modify-write is under a lock)
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_record_in_a_process, [(str(tmp_path), w, 24) for w in range(4)])
    table = configs.load(tmp_path / "nvidia-h100-80gb-hbm3.json")
    for w in range(4):
        assert sorted(table.get("gate_up", _problem(E=2 + w))) == [1 << i for i in range(24)]


def test_user_table_overrides_the_shipped_pick_by_pick(tables):
    # a user's table holding some buckets of a problem: those win, the shipped table's others still answer
    # (not the user's nearest bucket for every row count)
    user, shipped = tables
    c = GATE_UP.candidates
    p = _problem()
    _write(shipped / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", p, {64: c[1], 16384: c[2],
                                                                                  131072: c[3]})]))
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", p, {16384: c[4]})]))
    state = configs.tables_for(*H100)
    assert configs.lookup(state, GATE_UP, p, 16384) == (c[4], "table")
    assert configs.lookup(state, GATE_UP, p, 131072) == (c[3], "table")
    assert configs.lookup(state, GATE_UP, p, 64) == (c[1], "table")
    assert configs.lookup(state, GATE_UP, p, 8192)[0] == c[4]  # nearest over both: 16384


def test_shipped_tables_load_and_name_their_gpu():
    # every shipped table passes validation (a bad config would fail here, in CI, before any GPU run)
    files = configs.shipped_tables()
    assert files
    for f in files:
        t = configs.load(f)
        assert configs.table_name(t.device) == f.stem and t.capability == "9.0"
        assert t.entries, f


def test_pick_memoises_and_the_interpreter_runs_one_config(tables, monkeypatch):
    user, _ = tables
    c = GATE_UP.candidates
    _write(user / "nvidia-h100-80gb-hbm3.json", _table(*H100, [("gate_up", _problem(), {64: c[2]})]))
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    if options.INTERPRET:
        assert configs.pick(GATE_UP, _problem(), 64, torch.device("cpu")) == GATE_UP.interpret
    monkeypatch.setattr(configs, "INTERPRET", False)
    assert configs.pick(GATE_UP, _problem(), 50, torch.device("cpu")) == c[2]
    state = configs.tables_for(*H100)
    assert state.picks[("gate_up", _problem(), 64)] == c[2]
    state.user.entries.clear()  # the memo answers without the table
    assert configs.pick(GATE_UP, _problem(), 33, torch.device("cpu")) == c[2]


# ---------------------------------------------------------------------------------------------
# The run-time search, on a toy kernel


@triton.jit
def _toy_kernel(x_ptr, out_ptr, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out += 2 * x (reads its output: a search on the caller's buffer would add more than once)."""
    offs = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    o = tl.load(out_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, o + 2 * x, mask=mask)


_TOY_TILES = [Tile(16, 16, 16, 1, 1), Tile(32, 16, 16, 1, 1), Tile(64, 16, 16, 2, 2)]


@pytest.fixture
def toy(monkeypatch):
    fam = configs.Family("toy", _toy_kernel, _TOY_TILES, fields=("dtype", "N"), sizes=("N",), outputs=("out_ptr",),
                         interpret=_TOY_TILES[0])
    monkeypatch.setitem(configs.FAMILIES, "toy", fam)
    return fam


def _toy_launch(fam, x, out):
    n = x.numel()
    kernels.common.launch(fam, lambda meta: (triton.cdiv(n, meta["BLOCK_M"]),), x, out, n,
                          problem=("float32", 1), rows=n)


def test_search_times_every_candidate_on_scratch_outputs_and_records_the_fastest(tables, toy, monkeypatch):
    user, _ = tables
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(kernels.common, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    timed = []
    fake_ms = {_TOY_TILES[0]: 3.0, _TOY_TILES[1]: 1.0, _TOY_TILES[2]: 2.0}

    def timer(run, tile):
        run()
        timed.append(tile)
        return fake_ms[tile]

    monkeypatch.setattr(configs, "default_timer", timer)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(100, generator=gen).to(DEV)
    out0 = torch.randn(100, generator=gen).to(DEV)
    out = out0.clone()
    with options.override(autotune=True):
        _toy_launch(toy, x, out)
    assert timed == _TOY_TILES  # each candidate once
    assert torch.equal(out, out0 + 2 * x)  # the caller's buffer: the final launch alone
    saved = configs.load(user / "nvidia-h100-80gb-hbm3.json")
    assert saved.get("toy", ("float32", 1)) == {128: _TOY_TILES[1]} and saved.device == H100[0]
    # the same bucket again: no search
    with options.override(autotune=True):
        _toy_launch(toy, x[:90], out[:90])
    assert len(timed) == 3
    # a later process (tables read afresh) takes the recorded pick, searching or not
    configs.reset()
    launched = []
    real = configs.launch_eager
    monkeypatch.setattr(configs, "launch_eager", lambda f, tile, *a: launched.append(tile) or real(f, tile, *a))
    with options.override(autotune=True):
        _toy_launch(toy, x, out)
    _toy_launch(toy, x, out)
    assert launched == [_TOY_TILES[1]] * 2 and len(timed) == 3
    # another bucket is searched, and added to the same file
    with options.override(autotune=True):
        _toy_launch(toy, x[:20], out[:20])
    assert len(timed) == 6
    assert set(configs.load(user / "nvidia-h100-80gb-hbm3.json").get("toy", ("float32", 1))) == {32, 128}


def test_search_skips_a_candidate_the_gpu_cannot_run(tables, toy, monkeypatch):
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(kernels.common, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)

    class OutOfResources(Exception):
        pass

    def timer(run, tile):
        if tile == _TOY_TILES[1]:
            raise OutOfResources("shared memory")
        run()
        return 1.0 if tile == _TOY_TILES[2] else 2.0

    monkeypatch.setattr(configs, "default_timer", timer)
    x, out = torch.randn(10, device=DEV), torch.zeros(10, device=DEV)
    with options.override(autotune=True):
        _toy_launch(toy, x, out)
        assert configs.tables_for(*H100).picks[("toy", ("float32", 1), 16)] == _TOY_TILES[2]

    def broken(run, tile):
        raise ValueError("a real bug")

    monkeypatch.setattr(configs, "default_timer", broken)
    with options.override(autotune=True), pytest.raises(ValueError, match="a real bug"):
        _toy_launch(toy, x[:3], out[:3])  # any other error is not swallowed


def test_options_tables_dir_from_the_environment(tmp_path):
    assert options.from_env({"MOK_TABLES_DIR": str(tmp_path)}).tables_dir == str(tmp_path)
    assert options.from_env({}).tables_dir is None and options.from_env({}).autotune is False
    assert options.default_tables_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "mok_inductor" / "tables"
    with pytest.raises(TypeError, match="tables_dir"):
        mok_inductor.Options(tables_dir=3)
    assert mok_inductor.Options(tables_dir=tmp_path).tables_dir == str(tmp_path)


# ---------------------------------------------------------------------------------------------
# The tuning command


@pytest.mark.parametrize("cfg, ep, want", [
    ({"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 6144,
      "num_experts": 128, "num_experts_per_tok": 8}, 1, (2048, 768, 128, 8, 0)),
    ({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
      "num_experts_per_tok": 2}, 1, (4096, 14336, 8, 2, 0)),
    ({"model_type": "qwen2_moe", "hidden_size": 2048, "moe_intermediate_size": 1408, "num_experts": 60,
      "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632}, 1, (2048, 1408, 60, 4, 5632)),
    ({"model_type": "deepseek_v3", "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
      "num_experts_per_tok": 8, "n_shared_experts": 1}, 8, (7168, 2048, 32, 8, 2048)),
    ({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
      "experts_per_token": 4}, 1, (2880, 2880, 32, 4, 0)),
    ({"model_type": "granitemoeshared", "hidden_size": 1024, "intermediate_size": 512, "num_local_experts": 32,
      "num_experts_per_tok": 8, "shared_intermediate_size": 1024}, 1, (1024, 512, 32, 8, 1024)),
    ({"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_size": 5120,
      "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
      "num_experts_per_tok": 1}}, 1, (5120, 8192, 16, 1, 8192)),
])
def test_tune_reads_transformers_configs(tmp_path, cfg, ep, want):
    path = _write(tmp_path / "m" / "config.json", cfg)
    assert tune.shape_from_config(str(path.parent), ep) == want
    assert tune.shape_from_config(str(path), ep) == want


def test_tune_rejects_uneven_expert_parallelism(tmp_path):
    path = _write(tmp_path / "config.json", {"hidden_size": 8, "moe_intermediate_size": 8, "num_experts": 6,
                                             "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="6 experts do not divide over 4 ranks"):
        tune.shape_from_config(str(path), 4)


def test_tune_command_line_errors(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--hidden", "64"])
    assert "go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--preset", "nope"])
    assert "unknown preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main([])
    assert "give a shape" in capsys.readouterr().err
    assert tune.main(["--list-presets"]) == 0
    assert "mixtral-8x7b: hidden 4096" in capsys.readouterr().out


def test_tune_merge_replaces_picks_of_the_same_bucket_only(tmp_path):
    c = GATE_UP.candidates
    src, dst = tmp_path / "src", tmp_path / "dst"
    name = "nvidia-h100-80gb-hbm3.json"
    _write(dst / name, _table(*H100, [("gate_up", _problem(), {64: c[1], 128: c[2]})]))
    _write(src / name, _table(*H100, [("gate_up", _problem(), {64: c[3]}), ("gate_up", _problem(E=64), {1: c[4]})]))
    assert tune.merge_into(src, dst) == 2
    got = configs.load(dst / name)
    assert got.get("gate_up", _problem()) == {64: c[3], 128: c[2]} and got.get("gate_up", _problem(E=64)) == {1: c[4]}


def test_tune_shape_records_a_pick_for_every_launch(tmp_path, monkeypatch):
    # the layer (with a shared expert) forward and backward at two token counts through the Triton kernels
    # with the search on: every tuned launch gets a pick in the table (the timer here is a stand-in that does
    # not run the candidates; the toy-kernel test above runs them)
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(kernels.common, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    seen = []

    def timer(run, tile):
        seen.append(tile)
        return float(hash(tile) % 97)

    monkeypatch.setattr(configs, "default_timer", timer)
    # the final launch of each pick runs the family's small interpreter tile (cheap on the interpreter and on a GPU)
    real = configs.launch_eager
    monkeypatch.setattr(configs, "launch_eager", lambda fam, tile, *a: real(fam, fam.interpret, *a))
    steps = []
    with options.override(backend="triton"):
        tune.tune_shape((32, 16, 4, 2, 24), [1, 4], tmp_path, dtype=torch.float32, device=DEV,
                        progress=lambda i, T: steps.append((i, T)))
    assert steps == [(1, 1), (2, 4)]
    table = configs.load(tmp_path / "nvidia-h100-80gb-hbm3.json")
    fams = set(table.entries)
    assert {"gate_up", "grouped_rows", "wgrad"} <= fams and fams & {"bwd_act", "bwd_gemm"}
    for fam, problems in table.entries.items():
        for prob, per in problems.items():
            for b, tile in per.items():
                assert tile == min(configs.FAMILIES[fam].candidates, key=lambda t: hash(t) % 97)
    # the routed launches at 2 and 8 rows, the shared expert's (E = 1) at 1 and 4
    assert set(table.get("gate_up", ("float32", 32, 16, 4, False, False))) == {2, 8}
    assert set(table.get("gate_up", ("float32", 32, 24, 1, False, False))) == {1, 4}
    assert len(seen) == sum(len(configs.FAMILIES[f].candidates) * len(per)
                            for f, probs in table.entries.items() for per in probs.values())


@pytest.fixture
def as_on_h100(monkeypatch):
    """Launches read tables and search as on an H100 (not as under the interpreter); each runs its family's
    interpreter tile whatever the pick (cheap on the interpreter and on a GPU)."""
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(kernels.common, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda dev: H100)
    real = configs.launch_eager
    monkeypatch.setattr(configs, "launch_eager", lambda fam, tile, *a: real(fam, fam.interpret, *a))


def test_tune_shape_searches_the_gate_up_stage_and_reports_its_picks(tmp_path, as_on_h100):
    # bf16 without a clamp: the gate/up stage's two ways are timed at each bucket (the stand-in timer prefers
    # grouped_mm at 8 rows, the fused kernel at 2), recorded in the table, and `tune` names where grouped_mm won
    stage_fam = configs.FAMILIES["gate_up_stage"]
    rows = []

    def timer(run, tile):
        if tile.name:
            rows.append(tile.name)
            return 1.0 if (tile.name == "grouped_mm") == (len(rows) > 2) else 2.0
        return 0.0

    with options.override(backend="triton"), configs.timing_with(timer):
        tune.tune_shape((32, 16, 4, 2, 0), [1, 4], tmp_path, dtype=torch.bfloat16, device=DEV, backward=False)
    assert rows == ["fused", "grouped_mm"] * 2
    table = configs.load(tmp_path / "nvidia-h100-80gb-hbm3.json")
    prob = ("bfloat16", 32, 16, 4)
    assert table.get("gate_up_stage", prob) == {2: stage_fam.candidates[0], 8: stage_fam.candidates[1]}
    assert tune.stage_summary(table) == [
        "gate_up_stage (dtype bfloat16, H 32, I 16, E 4): grouped_mm at row buckets 8"]


def test_compiling_at_the_regime_token_counts_covers_every_launch(tmp_path, monkeypatch, as_on_h100):
    # `tune --jobs` compiles a shape's candidates at one token count per regime (`tune.regime_tokens`): those
    # runs must launch every (family, problem) that the runs at all token counts launch. Thresholds lowered so
    # that tiny shapes cross each of them under the interpreter.
    shape, tokens = (32, 16, 4, 2, 24), [1, 2, 3, 4, 6]
    limits = dict(tma_min_rows=1, two_pass_min_rows=2)  # (routes per expert T/2; the shared expert's rows T)

    def launched(tok, folder):
        with options.override(backend="triton", **limits), configs.timing_with(lambda run, tile: 0.0):
            tune.tune_shape(shape, tok, folder, dtype=torch.float32, device=DEV)
        table = configs.load(folder / "nvidia-h100-80gb-hbm3.json")
        return {(f, prob) for f, probs in table.entries.items() for prob in probs}

    with options.override(**limits):
        picked = tune.regime_tokens(shape, tokens)
    assert picked[0] == 1 and len(picked) < len(tokens)
    every = launched(tokens, tmp_path / "all")
    assert launched(picked, tmp_path / "regimes") == every
    assert len({p[-1] for f, p in every if f == "bwd_act"} | {f for f, p in every}) > 3  # variants were crossed


def test_precompile_runs_the_shapes_side_by_side_within_the_gpu_memory(monkeypatch, capsys):
    # `tune --jobs`: one --compile-only process per shape at its regime token counts, at most `jobs` at a
    # time and only while their estimated memory fits in 85% of the free GPU memory (a shape larger than
    # that alone still runs, alone); a failed one is reported, not fatal
    import argparse
    import types

    shapes = {n: tune.PRESETS[n] for n in ("gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x22b", "olmoe-1b-7b")}
    tokens = [1 << i for i in range(17)]
    peaks = {n: tune._peak_bytes(s, tune.regime_tokens(s, tokens, mxfp8=True), True) for n, s in shapes.items()}
    free = peaks["gpt-oss-120b"] / 0.85 + 1  # the largest fits alone, nothing beside it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free), int(2 * free)))
    live, seen, most = [], [], []

    class FakeProc:
        def __init__(self, cmd, **kw):
            self.args, self.polls = cmd, 0
            self.name = next(n for n, s in shapes.items() if cmd[cmd.index("--hidden") + 1] == str(s[0])
                             and cmd[cmd.index("--experts") + 1] == str(s[2]))
            live.append(self)
            seen.append(self.name)
            most.append((sum(peaks[p.name] for p in live), len(live)))
            want = tune.regime_tokens(shapes[self.name], tokens, mxfp8=True)
            assert cmd[cmd.index("--tokens") + 1] == ",".join(map(str, want))
            assert "--compile-only" in cmd and "--mxfp8" in cmd
            kw["stderr"].write(b"boom" if self.name == "olmoe-1b-7b" else b"")

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            live.remove(self) if self in live else None
            self.returncode = 1 if self.name == "olmoe-1b-7b" else 0
            return self.returncode

    monkeypatch.setattr(tune.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(tune.time, "sleep", lambda s: None)
    args = argparse.Namespace(dtype="bfloat16", mxfp8=True, forward_only=False)
    tune.precompile(shapes, {n: tokens for n in shapes}, args, jobs=3)
    assert sorted(seen) == sorted(shapes)
    for mem, n in most:
        assert mem <= 0.85 * free or n == 1, (mem, n)
    assert 2 <= max(n for _, n in most) <= 3  # side by side, never more than jobs
    err = capsys.readouterr().err
    assert "compiling olmoe-1b-7b failed" in err and "boom" in err and "compiled qwen3-30b-a3b" in err


def test_precompile_skips_a_shape_tuned_only_above_the_compile_cap(monkeypatch, capsys):
    # `tune --tokens 32768,65536 --jobs N`: no token count is small enough for a compile run (regime_tokens is
    # empty), so no process starts for the shape and its tuning compiles (not max() of an empty list)
    import argparse

    shapes = {"mixtral-8x7b": tune.PRESETS["mixtral-8x7b"]}
    assert tune.regime_tokens(shapes["mixtral-8x7b"], [32768, 65536]) == []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 36, 1 << 37))
    monkeypatch.setattr(tune.subprocess, "Popen", lambda *a, **k: pytest.fail("no compile process expected"))
    args = argparse.Namespace(dtype="bfloat16", mxfp8=False, forward_only=False)
    tune.precompile(shapes, {"mixtral-8x7b": [32768, 65536]}, args, jobs=4)
    assert "not compiling mixtral-8x7b ahead" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b", "qwen1.5-moe-a2.7b", "deepseek-v3-ep16"])
def test_default_tokens_give_every_launch_a_tuned_bucket_of_its_own_variant(name):
    # every token count up to the maximum launches the same kernel variants (regime) at the same row buckets
    # (routed: T*K rows, shared: T) as some tuned count: no launch takes another bucket's pick
    shape = tune.PRESETS[name]
    o = options.current()
    tokens = tune.default_tokens(shape, 16384)
    K = shape[3]
    tuned = {(tune._regime(shape, t, o), configs.bucket(t * K), configs.bucket(t)) for t in tokens}
    assert all((tune._regime(shape, T, o), configs.bucket(T * K), configs.bucket(T)) in tuned for T in range(1, 16385))
    assert set(tokens) >= {1 << i for i in range(15)} and len(tokens) < 15 + 8


def test_docs_list_the_presets_each_shipped_table_covers():
    # docs/api.md names, per shipped table file, the tuner presets whose routed gate/up problem (H, I, E) the
    # file holds: read back from the files, so the list cannot drift from what ships
    import os
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "api.md")).read()
    listed = dict(re.findall(r"^- `([a-z0-9.-]+\.json)`: ([a-z0-9., -]+)$", text, flags=re.M))
    shipped = configs.shipped_tables()
    assert sorted(listed) == sorted(p.name for p in shipped)
    for path in shipped:
        problems = {(e["problem"]["H"], e["problem"]["I"], e["problem"]["E"])
                    for e in json.loads(path.read_text())["families"]["gate_up"]}
        covered = sorted(name for name, (H, I, E, _, _) in tune.PRESETS.items() if (H, I, E) in problems)
        assert listed[path.name].split(", ") == covered, path.name


@pytest.mark.parametrize("E, K", [(3, 1), (60, 4), (7, 2), (128, 1), (32, 4)])
def test_default_tokens_with_mxfp8_cross_the_kernels_own_mx_loop_edges(E, K):
    # the MXFP8 forward's K loop as the kernels decide it (the fp16 loop, the dequantizing loop, the weights
    # dequantized up front) changes only between a token count and the next where `tune --mxfp8`'s default
    # counts hold the earlier one: each variant's last bucket is tuned (E not a power of two included)
    import types

    from mok_inductor.kernels import mx_loop

    o = options.current()
    q = types.SimpleNamespace(quantized=True)

    def decided(T):
        M = T * K
        return (mx_loop.use_mx_loop(torch.bfloat16, M, E, q, q) != mx_loop.MxLoop.DEQUANTIZE,
                kernels.common.at_least(M, o.mx_dequantize_min_rows * E, False))

    shape = (64, 32, E, K, 0)
    top = 2 * o.mx_dequantize_min_rows * E // K
    tokens = set(tune.default_tokens(shape, top, mxfp8=True))
    edges = [T - 1 for T in range(2, top + 1) if decided(T) != decided(T - 1)]
    assert len(edges) == 2 and set(edges) <= tokens, (edges, sorted(tokens))
    # without --mxfp8 the fp16 loop's edge is not added (it tunes nothing new; the dequantization's edge can
    # coincide with the two-pass backward's)
    f16_edge = edges[0]
    assert f16_edge in tokens and (f16_edge not in tune.default_tokens(shape, top) or f16_edge & (f16_edge - 1) == 0)


def _record_launches(monkeypatch):
    seen = []
    real = kernels.common._launch_tuned

    def spy(family, grid, args, kwargs, problem, rows):
        seen.append((family.name, problem))
        return real(family, grid, args, kwargs, problem, rows)

    monkeypatch.setattr(kernels.common, "_launch_tuned", spy)
    return seen


def test_mxfp8_weights_read_in_the_k_loop_are_their_own_problem(monkeypatch):
    # between the fp16 loop and the up-front dequantization, MXFP8 weights run the plain kernels with the weights
    # dequantized in the K loop: their table key says so (MX true), apart from the same launch on bf16 weights
    from mok_inductor import mxfp8 as mx

    seen = _record_launches(monkeypatch)
    H, I, E, K, T = 64, 32, 4, 2, 12  # 24 routes, 6 per expert: above 2 (fp16 loop), below 8 (dequantized)
    with options.override(backend="triton", mx_f16_dot_max_rows=2, mx_dequantize_min_rows=8, decode_max_routes=0):
        x, rw, te, w = tune._layer(T, H, I, E, K, 0, torch.bfloat16, DEV, torch.Generator(DEV).manual_seed(0))
        q = {k: mx.quantize(w[k].detach(), columnwise=False) for k in ("gate_up_proj", "down_proj")}
        with torch.no_grad():
            mok_inductor.moe(x.detach(), rw, te, q["gate_up_proj"], q["down_proj"])
            mx_launches = set(seen)
            seen.clear()
            mok_inductor.moe(x.detach(), rw, te, w["gate_up_proj"].detach(), w["down_proj"].detach())
    assert mx_launches == {("gate_up", ("bfloat16", H, I, E, False, True)),
                           ("grouped_rows", ("bfloat16", H, I, E, False, True, False, True))}
    assert set(seen) == {("gate_up", ("bfloat16", H, I, E, False, False)),
                         ("grouped_rows", ("bfloat16", H, I, E, False, True, False, False))}


def test_record_keeps_picks_another_process_wrote_since(tables, monkeypatch):
    # a searching process read the table, another rewrote a pick since: recording a new pick puts only that
    # one into the file as it is on disk (the other's change stays)
    user, _ = tables
    c = GATE_UP.candidates
    path = user / "nvidia-h100-80gb-hbm3.json"
    _write(path, _table(*H100, [("gate_up", _problem(), {64: c[1]})]))
    with options.override(autotune=True):
        state = configs.tables_for(*H100)
        _write(path, _table(*H100, [("gate_up", _problem(), {64: c[2]}), ("gate_up", _problem(E=64), {8: c[3]})]))
        configs.record(state, GATE_UP, _problem(), 1000, c[4])
    got = configs.load(path)
    assert got.get("gate_up", _problem()) == {64: c[2], 1024: c[4]}
    assert got.get("gate_up", _problem(E=64)) == {8: c[3]}
    assert state.user.get("gate_up", _problem()) == {64: c[2], 1024: c[4]}  # the memory follows the file


def test_autotuned_kernels_search_per_problem_not_per_row_count():
    # Inductor's max-autotune launches `Family.autotuned()`: Triton's autotuner caches a pick per value of its key,
    # which must name the problem (sizes, variant flags) so that two problems of one family do not share one
    for fam in configs.FAMILIES.values():
        if fam.is_stage:  # (no kernel of its own)
            continue
        key = fam.autotune_key
        assert set(key) <= set(fam.arg_names) and {"E", *[f for f in fam.fields if f in fam.arg_names]} <= set(key)
        assert "M" not in key and not any(k.startswith("BLOCK") for k in key)
    assert {"H", "I", "E", "TMA", "MX_G", "MX_U"} <= set(GATE_UP.autotune_key)


def test_tuning_layer_repeats_experts_when_a_rank_has_fewer_than_topk():
    # `--model ... --expert-parallel N` can leave fewer local experts than routes per token (mixtral over 8 ranks:
    # one expert, top-2): the layer's ids repeat experts instead of failing in torch.topk
    x, rw, te, w = tune._layer(5, 16, 8, 1, 2, 0, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert te.shape == (5, 2) and te.eq(0).all() and torch.allclose(rw.sum(-1), torch.ones(5))
    x, rw, te, w = tune._layer(64, 16, 8, 3, 4, 0, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert set(te.unique().tolist()) == {0, 1, 2}


def test_tune_config_errors_are_clear(tmp_path, capsys):
    path = _write(tmp_path / "config.json", {"hidden_size": 8, "moe_intermediate_size": 8, "num_experts": 4,
                                             "num_experts_per_tok": 2, "text_config": None})
    assert tune.shape_from_config(str(path)) == (8, 8, 4, 2, 0)
    with pytest.raises(ValueError, match="expected a number of ranks >= 1, got 0"):
        tune.shape_from_config(str(path), 0)
    with pytest.raises(FileNotFoundError, match="no such config file"):
        tune.shape_from_config(str(tmp_path / "missing.json"))
    with pytest.raises(SystemExit):
        tune.main(["--model", str(tmp_path / "missing.json")])
    assert "no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--model", str(path), "--expert-parallel", "3"])
    assert "4 experts do not divide over 3 ranks" in capsys.readouterr().err
