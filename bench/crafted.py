"""Crafted CUDA modules against the runtime on a real GPU: the checks of the code's own kernel
table and of per-call geometry, where only a GPU can run them.

    python bench/crafted.py build DIR        # here: a symbolic-batch MLP placed on cuda
    python bench/crafted.py run DIR [cuda]   # on the GPU machine (runtime only; cpu: the twins)

Each case edits the manifest, re-encodes the file with valid checksums, and runs it on
`--device=cuda` in a subprocess against numpy. An outcome is `refused` (a documented error,
named), `correct` (ran and matched numpy), or a failure: `WRONG` (exit 0 with a wrong answer)
or `CRASH` (the process died). Exit status 0 only if there is no failure. Cases marked
"(code)" edit the code's own description too (the cuda kernel table travels with the images,
as the code does): what they get is out of reach of any check that trusts the code (the trust
model in docs/hxb-format.md: signatures catch that), so a wrong answer there is reported, not
counted; a crash still is.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

W1 = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
W2 = np.random.default_rng(2).standard_normal((96, 10)).astype(np.float32)


def build(out: Path) -> None:
    import hexir

    def mlp(x):
        return hexir.linear(hexir.relu(hexir.linear(x, W1)), W2)

    out.mkdir(parents=True, exist_ok=True)
    hexir.export(mlp, out / "mlp.hxb", hexir.TensorSpec(("batch", 64), "float32"),
                 placement={"hexir.linear": "cuda", "hexir.relu": "cuda"})
    np.save(out / "w1.npy", W1)
    np.save(out / "w2.npy", W2)
    print(f"built {out / 'mlp.hxb'}")


def _table(manifest: dict, blobs: list) -> tuple[int, dict]:
    index = manifest["cuda"]["table"]
    return index, json.loads(blobs[index][1])


def _edit_table(manifest: dict, blobs: list, symbol: str, key: str, value: object) -> None:
    index, table = _table(manifest, blobs)
    for entry in table["kernels"]:
        if entry["symbol"] == symbol:
            entry[key] = value
    blobs[index] = (blobs[index][0], json.dumps(table).encode())


def cases(manifest: dict, blobs: list) -> list[tuple[str, dict, list]]:
    """(name, manifest, blobs) of each crafted module."""
    made = []
    kernel = next(k for k in manifest["kernels"] if k["device"] == "cuda" and k["op"] == "linear")
    names = [k["symbol"] for k in manifest["kernels"] if k["device"] == "cuda"]

    def case(name, edit):
        m, b = copy.deepcopy(manifest), list(blobs)
        edit(m, b, next(k for k in m["kernels"] if k["name"] == kernel["name"]))
        made.append((name, m, b))

    case("grid made huge in the manifest", lambda m, b, k: k["launch"].update(grid=[2**31 - 1, 65535, 65535]))
    case("grid made 1 block in the manifest", lambda m, b, k: k["launch"].update(grid=[1, 1, 1]))
    case("block made 1024 threads", lambda m, b, k: k["launch"].update(block=[1024, 1, 1]))
    case("symbol -> system", lambda m, b, k: k.update(symbol="system"))
    case("symbol -> another kernel", lambda m, b, k: k.update(symbol=next(s for s in names if s != k["symbol"])))
    case("sizes dropped", lambda m, b, k: k.update(sizes=[]))
    case("epilogues relabelled", lambda m, b, k: k.update(epilogues=["relu"] if not k["epilogues"] else []))
    case("an arg made static", lambda m, b, k: k["args"][0].update(shape=[4, k["args"][0]["shape"][1]]))

    def both(m, b, k, key, value):
        k[key] = value
        _edit_table(m, b, k["symbol"], key, value)
    case("(code) grid made 1 block in manifest and table",
         lambda m, b, k: both(m, b, k, "launch", {**k["launch"], "grid": [1, 1, 1]}))
    case("(code) grid doubled in manifest and table", lambda m, b, k: both(m, b, k, "launch", {
        **k["launch"], "grid": [["mul", g, 2] if isinstance(g, (str, list)) else g * 2 for g in k["launch"]["grid"]]}))
    case("variants' bounds swapped", lambda m, b, k: k.update(variants=[
        {**v, "below": {s: 1 for s in v["below"]}} for v in k.get("variants", [])]))

    def point_table_at_constant(m, b, k):
        m["cuda"]["table"] = next(i for i, (n, _) in enumerate(b) if n.startswith("constant"))
    case("cuda.table -> a constant's bytes", point_table_at_constant)

    def cubin_is_ptx(m, b, k):
        ptx = next(i for i, (n, _) in enumerate(b) if n.endswith(".ptx"))
        for kern in m["kernels"]:
            if "images" in kern:
                kern["images"] = {arch: ptx for arch in kern["images"]}
    case("every image -> the PTX bytes as a CUBIN", cubin_is_ptx)
    return made


RUN_ONE = """
import sys, numpy as np, hexir_runtime as r
data, x, expected = open(sys.argv[1], 'rb').read(), np.load(sys.argv[2]), np.load(sys.argv[3])
try:
    y = r.load(data, sys.argv[4]).main(x)
except r.HexirRuntimeError as e:
    print('refused', type(e).__name__, str(e)[:150].replace(chr(10), ' ')); sys.exit(0)
print('correct' if np.allclose(y, expected, rtol=1e-4, atol=1e-4) else 'WRONG')
"""


def run(folder: Path, device: str = "cuda") -> int:
    from hexir_runtime import format as hxb

    original = hxb.read(folder / "mlp.hxb")
    blobs = [(blob["name"], bytes(original.blob(i))) for i, blob in enumerate(original.json["blobs"])]
    manifest = {key: value for key, value in copy.deepcopy(original.json).items() if key != "blobs"}
    w1, w2 = np.load(folder / "w1.npy"), np.load(folder / "w2.npy")
    failures, rows = 0, []
    for batch in (3, 1000):
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        np.save(folder / "x.npy", x)
        np.save(folder / "expected.npy", np.maximum(x @ w1, 0) @ w2)
        for name, edited, edited_blobs in [("unedited", manifest, blobs), *cases(manifest, blobs)]:
            try:
                data = hxb.encode(edited, edited_blobs)
            except hxb.HxbFormatError as error:  # refused by the writer's own checks already
                rows.append((batch, name, f"refused HxbFormatError {error}"[:160]))
                continue
            (folder / "case.hxb").write_bytes(data)
            result = subprocess.run([sys.executable, "-c", RUN_ONE, str(folder / "case.hxb"), str(folder / "x.npy"),
                                     str(folder / "expected.npy"), device], capture_output=True, text=True, timeout=120)
            outcome = result.stdout.strip() if result.returncode == 0 else \
                f"CRASH (exit {result.returncode}): {result.stderr.strip()[-150:]}"
            failures += outcome.startswith("CRASH") or (outcome.startswith("WRONG") and not name.startswith("(code)")) \
                or (name == "unedited" and outcome != "correct")
            rows.append((batch, name, outcome))
    for batch, name, outcome in rows:
        print(f"batch {batch:>4}  {name:<42} {outcome}")
    print(f"{len(rows)} runs, {failures} failures (WRONG or CRASH)")
    return 1 if failures else 0


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    sys.exit(build(folder) if command == "build" else run(folder, *sys.argv[3:4]))
