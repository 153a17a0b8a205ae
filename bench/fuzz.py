"""Structure-aware fuzzing of the runtime (issue 12): mutate real modules, run them, compare.

    python bench/fuzz.py --count 100000 --jobs 2 [--seed 0] [--record bench/results/DATE-fuzz.md]

Base modules: the runtime tests' hand-built ones (tests/runtime/conftest.py: mlp with three
entries, a symbolic batch, a CUDA kernel with its cpu fallback) with a C library carrying its
kernel table, and, where hexir compiles here, compiled ones (cpu, and cuda-placed run with
--device=cpu). Each mutation edits the manifest (a leaf or subtree replaced by an interesting
value, a key dropped or added, list items swapped or duplicated), a blob (constants' values,
sizes, the cuda kernel table's JSON, the cpu library swapped for another module's, one without a
table, a truncated one, or one whose ELF would run code or load a library when dlopen maps it:
a constructor, a DT_NEEDED found through RUNPATH $ORIGIN), or, the kinds of issue 28, relabels
a generated kernel `custom` (its library the module's own cpu library, another blob, or none),
edits a cpu library's level (`features`, `cpu`, the builds' order), or downgrades the header's
version to 1 or 2; then the file is written again by `format.encode` (and its version patched),
so checksums and layout are right and only meaning can be wrong. Machine code is never mutated
byte by byte: a runtime cannot make arbitrary native code safe (that is what signatures are for).

Each file that encodes is run in a worker subprocess (a batch of them per process): loaded on
the cpu device and on the reference device, every entry called on fixed inputs. Outcomes:
- ok: both ran and agree; refused: a documented error (HexirRuntimeError) from either;
- unverified: the cpu ran it but the reference cannot (an op with no numpy version);
- wrong: both ran and disagree; undocumented: any other exception;
- crash: the worker died (the item is found as the first without a result, and re-run alone);
- hang: the worker timed out (likewise).
Targets: 0 wrong, 0 undocumented, 0 crashes, 0 hangs.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SELF = str(Path(__file__).resolve())  # workers run in the work folder (a RUNPATH $ORIGIN/../cwd points there)
sys.path[:0] = [str(ROOT / "runtime")]

from hexir_runtime import HexirRuntimeError, load  # noqa: E402
from hexir_runtime import format as hxb  # noqa: E402

BATCH = 250
BATCH_TIMEOUT = 120.0
ITEM_TIMEOUT = 20.0
INTS = [0, 1, 2, 3, -1, 7, 64, 1024, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 2**70]
STRINGS = ["", "batch", "n", "system", "printf", "relu", "linear", "custom", "float32", "float64", "cpu", "cuda",
           "read", "write", "main", "x", "sm_90", "compute_90", "ceildiv", "mul", "hexir_kernels", "bias", "gelu"]


# --- base modules ---------------------------------------------------------------------------


def base_modules(workdir: Path) -> list[tuple[str, dict, list, list[tuple[str, bytes]]]]:
    """(name, manifest, blobs, alternative cpu libraries (what each is, its bytes)) of every base module."""
    spec = importlib.util.spec_from_file_location("runtime_conftest", ROOT / "tests/runtime/conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    library = _cc(conftest.KERNELS_SOURCE, workdir / "kernels")
    untabled = _cc(conftest.KERNELS_CODE, workdir / "untabled")
    # Would run code at dlopen if loaded: a constructor that kills the worker (a crash, counted), a
    # library needing one found through RUNPATH $ORIGIN/../cwd: $ORIGIN is the memfd's /proc/self/fd,
    # so that is the worker's current directory (the workdir), where libdep.so's constructor kills it too.
    constructor = _cc(conftest.KERNELS_SOURCE + CONSTRUCTOR, workdir / "constructor")
    _cc(CONSTRUCTOR, workdir / "libdep")
    needs = _cc(conftest.KERNELS_SOURCE, workdir / "needs", [f"-L{workdir}", "-ldep", "-Wl,-rpath,$ORIGIN/../cwd",
                                                              "-Wl,--no-as-needed"])
    odd = [("constructor", constructor), ("DT_NEEDED via RUNPATH", needs)]
    libraries = [("another table", library), ("no table", untabled), ("truncated", library[: len(library) // 2]),
                 ("ELF magic only", b"\x7fELF"), *odd]
    bases = [(name, *getattr(conftest, name)(library), libraries) for name in ("mlp", "batched", "cuda")]
    return bases + [(name, manifest, blobs, alternatives + odd)
                    for name, manifest, blobs, alternatives in _compiled(workdir)]


CONSTRUCTOR = "#include <unistd.h>\n__attribute__((constructor)) static void ran(void) { _exit(86); }\n"


def _cc(source: str, stem: Path, flags: tuple[str, ...] = ()) -> bytes:
    """A shared object linked as hexir links its libraries (-nostartfiles), with `flags`."""
    stem.with_suffix(".c").write_text("#include <stdint.h>\n" + source)
    output = stem.with_suffix(".so")
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-nostartfiles", "-o", str(output), str(stem.with_suffix(".c")),
                    *flags], check=True)
    return output.read_bytes()


def _compiled(workdir: Path) -> list[tuple[str, dict, list, list[tuple[str, bytes]]]]:
    """Modules compiled by hexir (cpu, and cuda-placed), where it compiles here."""
    try:
        import hexir
    except ImportError as error:
        print(f"fuzz: no compiled modules ({error})", file=sys.stderr)
        return []
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(7).astype(np.float32)

    def mlp(x):
        return hexir.relu(hexir.linear(x, w, b))

    out = []
    for name, placement in [("compiled_cpu", None), ("compiled_cuda", {"hexir.linear": "cuda", "hexir.relu": "cuda"})]:
        path = workdir / f"{name}.hxb"
        try:
            options = {"placement": placement} if placement else {}
            hexir.export(mlp, path, hexir.TensorSpec(("batch", 5), "float32"), **options)
        except Exception as error:  # noqa: BLE001 - a compiler that cannot build this here: fuzz without it
            print(f"fuzz: cannot compile {name} ({type(error).__name__}: {error})", file=sys.stderr)
            continue
        module = hxb.read(path)
        manifest = {key: value for key, value in module.json.items() if key != "blobs"}
        blobs = [(blob["name"], bytes(module.blob(i))) for i, blob in enumerate(module.json["blobs"])]
        libraries = [(f"the {blob_name}", data) for blob_name, data in blobs if blob_name.endswith(".so")]
        out.append((name, manifest, blobs, libraries + [("truncated", libraries[0][1][:4096])]))
    return out


# --- mutations ------------------------------------------------------------------------------


def _paths(value, prefix=()):
    found = [prefix]
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in children:
        found += _paths(child, (*prefix, key))
    return found


def _value(rng: random.Random, old, manifest):
    kind = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and kind < 0.5:
        return rng.choice([old + 1, old - 1, old * 2, 0, -old, old + 2**32])
    if kind < 0.75:
        return rng.choice(INTS)
    if kind < 0.9:
        kernels = manifest.get("kernels") if isinstance(manifest.get("kernels"), list) else []
        symbols = [k.get("symbol") for k in kernels if isinstance(k, dict)]
        return rng.choice(STRINGS + [s for s in symbols if isinstance(s, str)])
    return rng.choice([None, True, [], {}, [1, 1, 1], ["ceildiv", "batch", 0], ["mul", "batch", 2**40], 2.0, [0]])


FEATURES = ["avx512f", "avx512bw", "avx2", "fma", "sse2", "avx9000"]


def relabel_custom(rng: random.Random, manifest: dict, blobs: list) -> str:
    """A generated kernel made `custom` (its code then called once, with every dimension as a
    scalar): its library the module's cpu library, another blob, or none (the module's library)."""
    kernels = [k for k in manifest.get("kernels", []) if isinstance(k, dict) and k.get("op") != "custom"]
    if not kernels:
        return "custom: skipped"
    kernel = rng.choice(kernels)
    for key in ("epilogues", "sizes", "work", "variants"):
        kernel.pop(key, None)
    args = kernel.get("args") if isinstance(kernel.get("args"), list) else []
    kernel.update(op="custom", source="relabelled.c",
                  scalars=[d for a in args if isinstance(a, dict) for d in a.get("shape", [])])
    code = kernel if kernel.get("device") == "cpu" else kernel.get("cpu_fallback")
    if isinstance(code, dict):
        code.pop("work", None)
        if code is not kernel:
            code["source"] = "relabelled.c"
        own = [b["library"] for b in manifest.get("cpu", {}).get("libraries", []) if isinstance(b, dict)]
        choice = rng.choice(["own", "own", "other", "none"])
        if choice == "own" and own:
            code["library"] = rng.choice(own)
        elif choice == "other" and blobs:
            code["library"] = rng.randrange(len(blobs))
    return f"custom relabel {kernel.get('name')}"


def edit_features(rng: random.Random, manifest: dict) -> str:
    """A cpu library's level changed: its features (an AVX-512 build said to need only SSE2),
    its `cpu`, or the builds reordered."""
    builds = manifest.get("cpu", {}).get("libraries") if isinstance(manifest.get("cpu"), dict) else None
    if not isinstance(builds, list) or not builds or not isinstance(builds[0], dict):
        return "features: skipped"
    build = rng.choice([b for b in builds if isinstance(b, dict)] or builds[:1])
    how = rng.choice(["basic", "add", "drop", "cpu", "reorder", "copy"])
    if how == "basic":
        build["features"] = ["sse", "sse2"]
    elif how == "add":
        build["features"] = [*build.get("features", []), rng.choice(FEATURES)]
    elif how == "drop" and build.get("features"):
        build["features"] = build["features"][1:]
    elif how == "cpu":
        build["cpu"] = rng.choice(["x86-64", "x86-64-v3", "x86-64-v4", "generic"])
    elif how == "reorder":
        rng.shuffle(builds)
    else:  # every build says what the most basic one says
        for other in builds:
            if isinstance(other, dict):
                other.update(cpu=builds[-1].get("cpu"), features=builds[-1].get("features"))
    return f"features {how}"


def mutate(rng: random.Random, manifest: dict, blobs: list,
           libraries: list[tuple[str, bytes]]) -> tuple[dict, list, str, int]:
    """A mutated (manifest, blobs), what was done, and the version to write in the header."""
    manifest, blobs = copy.deepcopy(manifest), list(blobs)
    done, version = [], hxb.VERSION
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        what = rng.random()
        if what >= 0.7:  # issue 28's kinds
            kind = rng.choice(["custom", "features", "version"])
            try:
                if kind == "custom":
                    done.append(relabel_custom(rng, manifest, blobs))
                elif kind == "features":
                    done.append(edit_features(rng, manifest))
            except (AttributeError, TypeError, KeyError, IndexError):  # an earlier edit broke what it edits
                done.append(f"{kind}: skipped")
            if kind == "version":
                version = rng.choice([1, 2])
                done.append(f"version {version}")
            continue
        what /= 0.7
        if what < 0.6:  # the manifest
            path = rng.choice(_paths(manifest)[1:])
            parent = manifest
            for key in path[:-1]:
                parent = parent[key]
            how = rng.choice(["replace", "replace", "delete", "add", "swap", "duplicate"])
            if how == "replace":
                parent[path[-1]] = _value(rng, parent[path[-1]], manifest)
            elif how == "delete":
                del parent[path[-1]]
            elif how == "add" and isinstance(parent, dict):
                parent[rng.choice(["extra", "op", "work", "launch", "library", "table", "symbol"])] = _value(
                    rng, None, manifest)
            elif how in ("swap", "duplicate") and isinstance(parent, list) and parent:
                other = rng.randrange(len(parent))
                if how == "swap":
                    parent[path[-1]], parent[other] = parent[other], parent[path[-1]]
                else:
                    parent.insert(other, copy.deepcopy(parent[path[-1]]))
            else:
                parent[path[-1]] = _value(rng, parent[path[-1]], manifest)
            done.append(f"{how} {'.'.join(map(str, path))}")
        elif what < 0.75:  # a constant's values (both devices see the same ones) or its size
            constants = [i for i, (name, _) in enumerate(blobs) if name.startswith("constant")]
            if not constants:
                continue
            i = rng.choice(constants)
            name, data = blobs[i]
            values = np.frombuffer(data, np.uint8).copy()
            if rng.random() < 0.7 and values.size:
                values[rng.randrange(values.size)] = rng.randrange(256)
                blobs[i] = (name, values.tobytes())
            else:
                blobs[i] = (name, data[: rng.randrange(len(data) + 1)] if rng.random() < 0.5 else data + b"\0" * 4)
            done.append(f"blob {name}")
        elif what < 0.85:  # the cuda kernel table
            tables = [i for i, (name, _) in enumerate(blobs) if name.endswith(".json")]
            if not tables:
                continue
            i = rng.choice(tables)
            try:
                table = json.loads(blobs[i][1].rstrip(b"\0"))
                path = rng.choice(_paths(table)[1:])
                parent = table
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = _value(rng, parent[path[-1]], manifest)
                blobs[i] = (blobs[i][0], json.dumps(table).encode())
            except (ValueError, TypeError, IndexError, KeyError):
                blobs[i] = (blobs[i][0], blobs[i][1][: len(blobs[i][1]) // 2])
            done.append("cuda table")
        else:  # the cpu library swapped for another (another table, none, truncated)
            own = [i for i, (name, _) in enumerate(blobs) if name.endswith(".so")]
            if not own:
                continue
            i = rng.choice(own)
            label, data = rng.choice(libraries)
            blobs[i] = (blobs[i][0], data)
            done.append(f"library {blobs[i][0]} -> {label}")
    return manifest, blobs, "; ".join(done), version


# --- running one file (in a worker) ---------------------------------------------------------


def inputs_for(module) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {}
    for entry in module.entries:
        shapes = [([3 if isinstance(d, str) else d for d in tensor.shape], tensor.dtype)
                  for _, tensor in module.signature(entry).inputs]
        arrays[entry] = [rng.standard_normal(shape).astype(dtype) for shape, dtype in shapes]
    return arrays


def outcome(data: bytes) -> str:
    """ok, refused, unverified, wrong or undocumented, for one encoded file."""
    try:
        module = load(data, "cpu")
        arrays = inputs_for(module)
        results = {entry: module.run(entry, *arrays[entry]) for entry in module.entries}
    except HexirRuntimeError as error:
        return f"refused {type(error).__name__}"
    except Exception as error:  # noqa: BLE001 - that is what is counted
        return f"undocumented {type(error).__name__}: {error}"[:300]
    try:
        reference = load(data, "reference")
        expected = {entry: reference.run(entry, *arrays[entry]) for entry in reference.entries}
    except HexirRuntimeError:
        return "unverified"
    except Exception as error:  # noqa: BLE001
        return f"undocumented (reference) {type(error).__name__}: {error}"[:300]
    for entry, result in results.items():
        got = result if isinstance(result, tuple) else (result,)
        want = expected[entry] if isinstance(expected[entry], tuple) else (expected[entry],)
        for a, b in zip(got, want, strict=True):
            if a is None or a.shape != b.shape or not np.allclose(a, b, rtol=1e-4, atol=1e-4, equal_nan=True):
                return f"wrong {entry}"
    return "ok"


def worker(batch_file: str) -> None:
    """Run every file of a batch; write `index outcome` lines to fd 1 as each finishes."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = io.StringIO()  # the modules' own prints
    with open(batch_file, "rb") as file:
        items = pickle.load(file)
    for index, data in items:
        sys.stdout.seek(0)
        sys.stdout.truncate()
        results.write(f"{index} {outcome(data)}\n".replace("\n", " ").rstrip() + "\n")


# --- the driver -----------------------------------------------------------------------------


def run_batch(items: list[tuple[int, bytes]], workdir: Path, timeout: float) -> dict[int, str]:
    """Outcomes of a batch; a dead or stuck worker's culprit is re-run alone (crash or hang)."""
    outcomes: dict[int, str] = {}
    while items:
        fd, name = tempfile.mkstemp(dir=workdir, suffix=".pickle")
        with os.fdopen(fd, "wb") as file:
            pickle.dump(items, file)
        try:
            result = subprocess.run([sys.executable, SELF, "--worker", name], capture_output=True, text=True,
                                    timeout=timeout, cwd=workdir)
            stdout, died = result.stdout, result.returncode != 0
        except subprocess.TimeoutExpired as expired:
            stdout, died = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (
                expired.stdout or ""), True
        finally:
            os.unlink(name)
        for line in stdout.splitlines():
            index, _, text = line.partition(" ")
            if index.isdigit():
                outcomes[int(index)] = text
        items = [item for item in items if item[0] not in outcomes]
        if items and died:  # the first item without a result killed or stalled the worker: re-run it alone
            outcomes[items[0][0]] = _alone(items[0], workdir)
            items = items[1:]
        elif items:
            outcomes.update({index: "crash (no result)" for index, _ in items})
            break
    return outcomes


def _alone(item: tuple[int, bytes], workdir: Path) -> str:
    fd, name = tempfile.mkstemp(dir=workdir, suffix=".pickle")
    with os.fdopen(fd, "wb") as file:
        pickle.dump([item], file)
    try:
        result = subprocess.run([sys.executable, SELF, "--worker", name], capture_output=True, text=True,
                                timeout=ITEM_TIMEOUT, cwd=workdir)
        if result.returncode != 0:
            return f"crash (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:] }"[:300]
        return result.stdout.partition(" ")[2].strip() or "crash (no result)"
    except subprocess.TimeoutExpired:
        return "hang"
    finally:
        os.unlink(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, help="stop making mutants after this long (the count run is reported)")
    parser.add_argument("--record", help="write the counts as markdown to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    workdir = Path(tempfile.mkdtemp(prefix="hexir-fuzz-"))
    started = time.time()
    try:
        bases = base_modules(workdir)
        begun = time.time()  # --minutes counts from here
        rng = random.Random(args.seed)
        counts: Counter[str] = Counter()
        examples: dict[str, str] = {}
        by_base: Counter[str] = Counter()
        by_kind: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS.values()}
        made = [0]

        def batches():
            index = 0
            while index < args.count and not (args.minutes and time.time() - begun > 60 * args.minutes):
                items, described = [], {}
                while len(items) < BATCH and index < args.count:
                    name, manifest, blobs, libraries = rng.choice(bases)
                    mutated, changed, how, version = mutate(rng, manifest, blobs, libraries)
                    by_base[name] += 1
                    try:
                        data = bytearray(hxb.encode(mutated, changed))
                        data[8:12] = version.to_bytes(4, "little")  # a downgrade: outside every checksum
                        items.append((index, bytes(data)))
                        described[index] = f"{name}: {how}"
                    except hxb.HxbFormatError:
                        counts["refused at encode (HxbFormatError)"] += 1
                        for kind in _kinds(how):
                            by_kind[kind]["refused at encode"] += 1
                    except Exception as error:  # noqa: BLE001
                        counts["undocumented at encode"] += 1
                        examples.setdefault("undocumented at encode", f"{name}: {how}: {type(error).__name__} {error}")
                    index += 1
                    made[0] = index
                yield items, described

        with ThreadPoolExecutor(args.jobs) as pool:
            pending = []
            for items, described in batches():
                pending.append((pool.submit(run_batch, items, workdir, BATCH_TIMEOUT), described))
                if len(pending) >= 2 * args.jobs:
                    _collect(pending.pop(0), counts, examples, by_kind)
            for job in pending:
                _collect(job, counts, examples, by_kind)
        elapsed = time.time() - started
        report = _report(args, made[0], counts, examples, by_base, by_kind, elapsed)
        print(report)
        if args.record:
            Path(args.record).write_text(report)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


KINDS = {"custom": "custom relabel", "features": "features edit", "version": "version downgrade",
         "-> constructor": "library with a constructor", "-> DT_NEEDED": "library needing one via RUNPATH"}


def _kinds(how: str) -> list[str]:
    """Which of issue 28's mutation kinds a mutant's description shows."""
    done = [part.split(": ", 1)[-1] for part in how.split("; ")]  # (the base module's name first)
    return [kind for marker, kind in KINDS.items()
            if any(part.startswith(marker) or marker.startswith("->") and marker in part for part in done)
            and not any(part == f"{marker}: skipped" for part in done)]


def _collect(job, counts: Counter[str], examples: dict[str, str], by_kind: dict[str, Counter[str]]) -> None:
    future, described = job
    for index, text in future.result().items():
        kind = text.split(" ")[0] if not text.startswith("refused") else text
        counts[kind] += 1
        for mutation in _kinds(described[index]):
            by_kind[mutation][kind.split(" (")[0]] += 1
        if kind in ("wrong", "undocumented", "crash", "hang"):
            examples.setdefault(f"{kind} {len(examples)}", f"{described[index]} -> {text}")


def _report(args, made: int, counts: Counter[str], examples: dict[str, str], by_base: Counter[str],
            by_kind: dict[str, Counter[str]], elapsed: float) -> str:
    bad = {kind: counts[kind] for kind in ("crash", "hang", "wrong", "undocumented")}
    limit = f" --minutes {args.minutes:g}" if args.minutes else ""
    asked = f" (of {args.count} asked)" if made < args.count else ""
    lines = [f"# Fuzz run: {made} structure-aware mutations{asked}",
             "", f"Command: `python bench/fuzz.py --count {args.count} --jobs {args.jobs} --seed {args.seed}{limit}`, "
             f"finished {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
             f"Time: {elapsed / 60:.1f} min on {os.cpu_count()} cores. Base modules: "
             + ", ".join(f"{name} ({count})" for name, count in sorted(by_base.items())), "",
             f"**crashes {bad['crash']}, hangs {bad['hang']}, wrong outputs with exit 0 {bad['wrong']}, "
             f"undocumented exceptions {bad['undocumented']}**", "", "| outcome | count |", "|---|---:|"]
    lines += [f"| {kind} | {count} |" for kind, count in counts.most_common()]
    lines += ["", "Issue 28's kinds (a mutant may have several; outcomes of the mutants that have each):", "",
              "| kind | outcomes |", "|---|---|"]
    lines += [f"| {kind} | {', '.join(f'{outcome} {n}' for outcome, n in tally.most_common()) or 'none'} |"
              for kind, tally in by_kind.items()]
    if examples:
        lines += ["", "Examples:", ""] + [f"- {key}: `{text}`" for key, text in list(examples.items())[:20]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
