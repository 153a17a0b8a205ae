"""The CPU ≡ GPU property suite, in two halves: build here (MLIR), run there (runtime only).

    python tests/gpu/suite.py build bench/gpu_cases [--examples 120]   # on a machine with hexir
    python tests/gpu/suite.py build DIR --part families                # only the op-family cases
    python tests/gpu/suite.py run bench/gpu_cases                      # on the GPU machine

`build` lets hypothesis draw cases — an op chain (linear, linear+bias, relu, linear+relu),
a dtype, shapes with 1, primes and sizes no block size divides, up to a few thousand, and a
placement of every op (every combination for linear+relu) — and compiles each to a small
.hxb whose weights are *arguments*, so the files stay small and the values are drawn where
they run. Symbolic cases have a batch (`M`) known only at run time: one module, and `run`
draws several batch sizes for it (0 and 1 among them). `run` draws random values for each
case, runs it with `--device=cuda` and `--device=cpu` (the cpu twins of the GPU kernels),
compares both with numpy in float64 and prints a summary. Exit status 0 only if every case
passes.

The op-family cases (families.py, #23) add every registered pointwise and reduce op (from the
registry: a new op is covered when it is registered), fused chains (broadcasting, linear
epilogues, residuals, reductions with a prologue, argmax, middle axes), placements that split a
chain between cuda and cpu, and long rows (softmax, layer_norm, log_softmax up to 16384
columns), each in float32 and float64 with a symbolic batch run at several sizes (0 among them);
their tolerances are stated per op in families.py. The layout ops (#24: transposes, reshapes,
slices, concat lists, take with int32/int64 ids) must match numpy exactly, and a take given an id
out of range must be refused on every device with an InputError naming the input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import families  # noqa: E402  (beside this file; imports hexir only to build)

# Relative error bounds against the float64 reference, by dtype (summation order differs).
TOLERANCE = {"float32": 1e-4, "float64": 1e-11, "bfloat16": 2**-8, "float16": 2**-10}  # (16-bit: one rounding)
HALVES = ("bfloat16", "float16")  # (#26: computed in float32; numpy needs ml_dtypes for bfloat16)
CHAINS = ("linear", "linear_bias", "relu", "linear_relu")
#: (linear, relu) devices for linear+relu: every combination that has a GPU op.
SPLITS = (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda"))
#: Batch sizes a symbolic case is run with: empty, one row, and around every tile edge.
BATCHES = (0, 1, 2, 3, 31, 63, 64, 65, 127, 128, 129, 255, 1000, 2053)


def build(out: Path, examples: int, part: str = "all", dtypes: tuple[str, ...] = ()) -> None:
    """Compile the cases into `out` (only those of `dtypes`, when given)."""
    import hexir

    out.mkdir(parents=True, exist_ok=True)
    cases: list[dict] = []
    if part in ("all", "linear"):
        cases += build_linear(out, examples, dtypes)
    if part in ("all", "families"):
        def add_family(record, function, specs, placement):
            name = f"fam{len(cases):03d}"
            hexir.export(function, out / f"{name}.hxb", *specs, placement=placement, target="cuda:sm_90")
            cases.append({**record, "kind": "family", "name": name, "placement": placement})
        families.build(out, add_family, dtypes)
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    print(f"built {len(cases)} cases in {out}")


def build_linear(out: Path, examples: int, dtypes: tuple[str, ...] = ()) -> list[dict]:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import hexir

    interesting = st.sampled_from([1, 2, 3, 7, 13, 31, 32, 33, 97, 127, 255, 257, 1000, 1031, 2053, 3001])
    small = st.one_of(interesting.filter(lambda d: d <= 257), st.integers(1, 300))
    cases: list[dict] = []

    @settings(max_examples=examples, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(chain=st.sampled_from(CHAINS), dtype=st.sampled_from(["float32", "float64"]),
           big_axis=st.sampled_from("MKN"), big=interesting, m=small, k=small, n=small,
           split=st.sampled_from(SPLITS), symbolic=st.booleans())
    def draw(chain, dtype, big_axis, big, m, k, n, split, symbolic):
        dims = {"M": m, "K": k, "N": n, big_axis: big}  # one axis may be large, the others moderate
        add(chain, dtype, dims["M"], dims["K"], dims["N"], split, symbolic)

    def add(chain, dtype, m, k, n, split, symbolic=False):
        if dtypes and dtype not in dtypes:
            return
        # single-op chains put their op on the GPU; linear+relu takes every split with a GPU op
        linear_device, relu_device = split if chain == "linear_relu" else ("cuda", "cuda")
        specs, fn = _case_function(chain, "batch" if symbolic else m, k, n, dtype)
        placement = {"hexir.linear": linear_device, "hexir.relu": relu_device}
        name = f"case{len(cases):03d}"
        hexir.export(fn, out / f"{name}.hxb", *specs, placement=placement, target="cuda:sm_90")
        cases.append({"name": name, "chain": chain, "dtype": dtype, "m": "batch" if symbolic else m, "k": k,
                      "n": n, "placement": placement, "inputs": [list(s.shape) for s in specs]})

    # Every chain, dtype and split once at awkward sizes, then what hypothesis draws.
    for chain in CHAINS:
        for dtype in ("float32", "float64"):
            for split in (SPLITS if chain == "linear_relu" else SPLITS[:1]):
                add(chain, dtype, 1, 1, 1, split)
                add(chain, dtype, 4, 300, 97, split)  # the rows kernel with 32 warps
                add(chain, dtype, 13, 1031, 33, split)  # and with 16 (f64: 8 k's per warp per step)
                add(chain, dtype, 33, 257, 97, split)  # split-K: 4 parts, the last cut at K
                add(chain, dtype, 64, 784, 510, split)  # split-K: 7 parts of 32x32 (f64: DMMA) tiles
                add(chain, dtype, 17, 3001, 7, split)  # split-K: 8 parts, 16x16 tiles
                if chain != "relu":  # f64: 128x128 tiles (528 of them), K even but not of 16, edges cut
                    add(chain, dtype, 3001, 34, 2798, split)
                add(chain, dtype, None, 257, 97, split, symbolic=True)
                add(chain, dtype, None, 3, 1031, split, symbolic=True)
    # bfloat16 and float16 (#26): the float32 GEMM between casts, or the 16-bit kernels where the
    # cuda schedule takes them (native_16bit): the rows kernel, split-K, tiles, symbolic rows
    for dtype in HALVES:
        for chain in CHAINS:
            for m, k, n in ((4, 300, 97), (33, 257, 97), (64, 784, 510), (3001, 34, 2798)):
                add(chain, dtype, m, k, n, SPLITS[0])
            add(chain, dtype, None, 257, 97, SPLITS[0], symbolic=True)
    # The rows kernel at its most rows (16 warps), K in 17 chunks, the last cut: every warp of
    # the K split has work, so a partial sum left out of the warps' total shows
    for dtype in ("float32", "float64"):
        add("linear_bias", dtype, 16, 2053, 40, SPLITS[0])
    # float64 on the tensor cores (sm_90: m16n8k4) in each DMMA tiling the cases above leave to
    # the symbolic ones' drawn batches, at sizes no tile divides, so that a C fragment value
    # stored to another row or column shows: 64x32 (odd K), 64x64, 128x64 through registers (odd
    # K) and through cp.async (even K and N); 32x32 and 128x128 are above
    for m, k, n in ((200, 65, 1000), (1000, 33, 1000), (2100, 33, 1000), (2100, 34, 1000)):
        add("linear_bias", "float64", m, k, n, SPLITS[0])
    draw()
    return cases


def _case_function(chain: str, m: int, k: int, n: int, dtype: str):
    import hexir

    spec = hexir.TensorSpec
    if chain == "relu":
        def f(x):
            return hexir.relu(x)
        return (spec((m, n), dtype),), f
    if chain == "linear":
        def f(x, w):
            return hexir.linear(x, w)
        return (spec((m, k), dtype), spec((k, n), dtype)), f
    if chain == "linear_bias":
        def f(x, w, b):
            return hexir.linear(x, w, b)
        return (spec((m, k), dtype), spec((k, n), dtype), spec((n,), dtype)), f

    def f(x, w):
        return hexir.relu(hexir.linear(x, w))
    return (spec((m, k), dtype), spec((k, n), dtype)), f


def reference(chain: str, arrays: list[np.ndarray]) -> np.ndarray:
    wide = [a.astype(np.float64) for a in arrays]
    if chain == "relu":
        return np.maximum(wide[0], 0)
    result = wide[0] @ wide[1]
    if chain == "linear_bias":
        result = result + wide[2]
    return np.maximum(result, 0) if chain == "linear_relu" else result


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = np.linalg.norm(expected)
    difference = np.linalg.norm(actual.astype(np.float64) - expected)
    return float(difference / scale) if scale else float(difference)


def run(cases_dir: Path, devices: tuple[str, ...], seed: int) -> int:
    import hexir_runtime

    try:
        import ml_dtypes  # noqa: F401 - numpy's name "bfloat16"
    except ImportError:
        pass  # (the bfloat16 cases' modules then say what to install)
    every = json.loads((cases_dir / "cases.json").read_text())
    cases = [case for case in every if "kind" not in case]  # the linear cases; then the families'
    rng = np.random.default_rng(seed)
    failures, worst, started = [], {d: 0.0 for d in devices}, time.perf_counter()
    device_line = ""
    runs = []
    for case in cases:  # a symbolic case runs at three batch sizes drawn here
        batches = rng.choice(BATCHES, 3, replace=False) if case["m"] == "batch" else [None]
        runs += [(case, [[int(b) if d == "batch" else d for d in shape] for shape in case["inputs"]])
                 for b in batches]
    for case, shapes in runs:
        arrays = [rng.standard_normal(shape).astype(case["dtype"]) for shape in shapes]
        expected = reference(case["chain"], arrays)
        results = {}
        for device in devices:
            try:
                module = hexir_runtime.load(cases_dir / f"{case['name']}.hxb", device=device)
                device_line = device_line or (module.device_name if device == "cuda" else "")
                results[device] = module.main(*arrays)
            except hexir_runtime.HexirRuntimeError as error:
                failures.append(f"{case['name']} on {device}: {error}")
                continue
            error = relative_error(results[device], expected)
            worst[device] = max(worst[device], error)
            if not error <= TOLERANCE[case["dtype"]] or np.isnan(results[device].astype(np.float64)).any():
                failures.append(f"{case['name']} ({case['chain']} {case['dtype']} M={shapes[0][0]} K={case['k']} "
                                f"N={case['n']} {case['placement']}) on {device}: relative error {error:.3e}")
        bound = TOLERANCE[case["dtype"]] * 10
        scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
        if len(results) == 2 and not np.allclose(*(results[d].astype(np.float64) for d in devices),
                                                  rtol=bound, atol=bound * scale):
            failures.append(f"{case['name']}: {devices[0]} and {devices[1]} disagree")
    family_runs, family_failures, used = run_families(cases_dir, [c for c in every if "kind" in c], devices, rng)
    elapsed = time.perf_counter() - started
    print(f"device        : {device_line or ', '.join(devices)}")
    counts = ", ".join(f"{chain}: {sum(c['chain'] == chain for c in cases)}" for chain in CHAINS)
    print(f"cases         : {len(cases)} ({counts})")
    for dtype in TOLERANCE:
        print(f"{dtype:<14}: {sum(c['dtype'] == dtype for c in cases)} cases, tolerance {TOLERANCE[dtype]:.0e}")
    for device in devices:
        print(f"max rel error : {device} {worst[device]:.3e} (vs numpy float64)")
    print(f"symbolic      : {sum(c['m'] == 'batch' for c in cases)} cases, each at 3 batch sizes")
    outputs = [o for c in every if "kind" in c for o in c["outputs"]]
    kinds = {kind: sum(o["what"] == kind for o in outputs) for kind in ("op", "chain", "long")}
    print(f"family cases  : {len(every) - len(cases)} modules, {len(outputs)} outputs (registered ops: {kinds['op']}, "
          f"fused chains: {kinds['chain']}, long rows: {kinds['long']}), {family_runs} output checks per device")
    for device in devices:
        print(f"family error  : {device} at most {used[device]:.3f} of the tolerance (families.py)")
    total = len(runs) * len(devices) + family_runs * len(devices)  # (a module's load failure: one more)
    failures += family_failures
    print(f"passed        : {total - len(failures)} of {total} runs in {elapsed:.1f} s")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


def run_families(cases_dir: Path, cases: list[dict], devices: tuple[str, ...], rng) -> tuple[int, list[str], dict]:
    """Each family module at each of its batch sizes on every device; each of its outputs
    against float64 numpy (families.NUMPY) or, for an op it does not know, the reference
    device. Returns (outputs checked per device, failures, the largest share of a tolerance used)."""
    import hexir_runtime

    failures, used, checked = [], {d: 0.0 for d in devices}, 0
    for case in cases:
        where = f"{case['name']} ({case['label']}, {case['dtype']}, {case['placement']})"
        modules = {}
        for device in (*devices, "reference"):
            try:
                modules[device] = hexir_runtime.load(cases_dir / f"{case['name']}.hxb", device=device)
            except hexir_runtime.HexirRuntimeError as error:
                failures.append(f"{where} on {device}: {error}")
        if "bad_id" in case:  # an id out of range: an InputError naming the input on every device
            failures += _bad_id(case, modules, rng, where)
            continue
        for batch in case.get("batches", families.BATCHES) if modules else ():  # (those that loaded)
            arrays = families.draw(case, rng, batch)
            results = {}
            for device, module in modules.items():
                try:
                    result = module.main(*arrays)
                    results[device] = result if isinstance(result, tuple) else (result,)
                except hexir_runtime.HexirRuntimeError as error:
                    failures.append(f"{where} batch {batch} on {device}: {error}")
            for index, output in enumerate(case["outputs"]):
                checked += 1
                want, oracle = families.expected(output, arrays), "numpy"
                if want is None and "reference" in results:
                    want, oracle = results["reference"][index].astype(np.float64), "the reference device"
                for device in devices if want is not None else ():
                    if device not in results:
                        continue
                    got = results[device][index]
                    why = families.compare(output, case["dtype"], got, want)
                    if why is not None:
                        failures.append(f"{where} batch {batch}: {families.label(output)} on {device} vs {oracle}: "
                                        f"{why}")
                    elif np.asarray(want).dtype.kind == "f" and np.size(want):
                        rtol, atol = families.tolerance(output, case["dtype"])
                        share = np.abs(np.asarray(got, np.float64) - want) / (atol + rtol * np.abs(want))
                        used[device] = max(used[device], float(share.max()))
    return checked, failures, used


def _bad_id(case: dict, modules: dict, rng, where: str) -> list[str]:
    """Run a take whose input `case["bad_id"]` holds one id equal to its table's rows."""
    import hexir_runtime

    arrays = families.draw(case, rng, 7)
    position = case["bad_id"]
    arrays[position].flat[5] = case["inputs"][position]["ids"]
    failures = []
    for device, module in modules.items():
        try:
            module.main(*arrays)
            failures.append(f"{where} on {device}: an id out of range was not refused")
        except hexir_runtime.InputError as error:
            if f"input 'x{position}' holds the id {case['inputs'][position]['ids']}" not in str(error):
                failures.append(f"{where} on {device}: the error does not name the input and the id: {error}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="draw and compile cases (needs hexir)")
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--examples", type=int, default=120)
    build_parser.add_argument("--part", choices=("all", "linear", "families"), default="all",
                              help="the linear cases, the op-family cases (families.py) or both")
    build_parser.add_argument("--dtypes", default="", help="only the cases of these dtypes (comma separated)")
    run_parser = commands.add_parser("run", help="run the cases (needs only hexir_runtime)")
    run_parser.add_argument("cases", type=Path)
    run_parser.add_argument("--devices", default="cuda,cpu", help="devices to run and compare")
    run_parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out, args.examples, args.part, tuple(filter(None, args.dtypes.split(","))))
        return 0
    return run(args.cases, tuple(args.devices.split(",")), args.seed)


if __name__ == "__main__":
    sys.exit(main())
