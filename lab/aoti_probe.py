"""Lab (kept in git history, removed from the tree): which AOTInductor packages crash at load on this machine.
Four small models, each exported (dynamic token count), packaged with aoti_compile_and_package, then loaded and
run in a fresh process (faulthandler on, so a segfault prints the Python stack): plain (Linear + ReLU, no mok),
router (Linear + softmax + topk), mok (router + mok_inductor.moe, ops as proxy calls), mok-enabled (the same
compiled after mok_inductor.enable(): the Triton kernels in the package on CUDA). Each load runs with and
without `import mok_inductor`. If `plain` crashes too, the crash is the environment's, not mok's.

    python lab/aoti_probe.py [--device cuda|cpu] [--out DIR]      -> aoti_probe.json
"""
import argparse, json, os, subprocess, sys, tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import mok_inductor  # noqa: E402

H, I, E, K = 64, 32, 4, 2

LOAD = """
import faulthandler, sys
faulthandler.enable()
import torch
if sys.argv[2] == "import":
    import mok_inductor  # noqa: F401
print("loading", flush=True)
runner = torch._inductor.aoti_load_package(sys.argv[1])
print("loaded", flush=True)
x = torch.load(sys.argv[1] + ".x.pt")
y = runner(x)
torch.save(y if isinstance(y, torch.Tensor) else y[0], sys.argv[1] + ".y.pt")
print("ran", flush=True)
"""


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(H, H)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Parameter(torch.randn(E, H) * H ** -0.5)

    def forward(self, x):
        rw, te = torch.topk((x @ self.router.T).softmax(-1), K)
        return rw * te.to(rw.dtype)


class Moe(Router):
    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * I, H) * H ** -0.5)
        self.down = torch.nn.Parameter(torch.randn(E, H, I) * I ** -0.5)

    def forward(self, x):
        rw, te = torch.topk((x @ self.router.T).softmax(-1), K)
        return mok_inductor.moe(x, rw, te, self.gate_up, self.down)


def build(name, model, device, dtype, folder, enabled):
    model = model.to(device=device, dtype=dtype)
    x0 = torch.randn(16, H, device=device, dtype=dtype)
    path = os.path.join(folder, f"{name}.pt2")
    try:
        if enabled:
            with mok_inductor.enabled():
                ep = torch.export.export(model, (x0,), dynamic_shapes=({0: torch.export.Dim("T", min=1, max=4096)},))
                torch._inductor.aoti_compile_and_package(ep, package_path=path)
        else:
            ep = torch.export.export(model, (x0,), dynamic_shapes=({0: torch.export.Dim("T", min=1, max=4096)},))
            torch._inductor.aoti_compile_and_package(ep, package_path=path)
    except Exception as ex:
        return path, f"build failed: {type(ex).__name__}: {str(ex)[:300]}", None
    x = torch.randn(37, H, device=device, dtype=dtype)
    torch.save(x, path + ".x.pt")
    with torch.no_grad():
        want = model(x)
    return path, "built", want if isinstance(want, torch.Tensor) else want[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    folder = tempfile.mkdtemp(prefix="aoti-probe-")
    torch.manual_seed(0)
    cases = [("plain", Plain(), False), ("router", Router(), False), ("mok", Moe(), False)]
    if a.device == "cuda":
        cases.append(("mok-enabled", Moe(), True))
    report = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__}
    for name, model, enabled in cases:
        path, built, want = build(name, model, a.device, dtype, folder, enabled)
        entry = {"build": built}
        if want is not None:
            for mode in ("import", "bare"):
                run = subprocess.run([sys.executable, "-c", LOAD, path, mode], capture_output=True, text=True,
                                     timeout=600)
                res = {"rc": run.returncode, "stdout": run.stdout.strip().splitlines()[-1:],
                       "stderr_tail": run.stderr[-1500:]}
                if run.returncode == 0:
                    got = torch.load(path + ".y.pt").float().cpu()
                    res["rel_err"] = ((got - want.float().cpu()).norm() / want.float().cpu().norm()).item()
                entry[mode] = res
        report[name] = entry
        print(name, json.dumps({k: (v if k == "build" else {kk: vv for kk, vv in v.items() if kk != "stderr_tail"})
                                for k, v in entry.items()}), flush=True)
    json.dump(report, open(os.path.join(a.out, "aoti_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
