"""Experiment: the cpu linear's tile sizes (schedules/cpu.py: NC_BYTES, MC_CHOICES, WORK_ITEMS,
KS, STREAM_ROWS), measured on a many-core host against numpy in the same run.

    PYTHONPATH=runtime:. python bench/cpu_tilings.py DIR                          # here: build
    PYTHONPATH=runtime python bench/linear.py run DIR --device cpu --repeats 5    # there

Builds the same products once per variant of the table, by overriding the schedule's
constants for the duration of the build (the compile cache is off: its key cannot see them).
"""

import json
import os
import sys
from pathlib import Path

os.environ["HEXIR_CACHE_DIR"] = ""

import hexir
from hexir.schedules import cpu as cpu_schedule

#: name -> the constants it changes from the committed table.
VARIANTS = {
    "base": {},
    "mc24": {"MC_CHOICES": (192, 96, 48, 24)},
    "nc512": {"NC_BYTES": 512},
    "mc24nc512": {"MC_CHOICES": (192, 96, 48, 24), "NC_BYTES": 512},
    "items64": {"WORK_ITEMS": 64},
}
SIZES = [(256, 256, 256, "float32"), (256, 256, 256, "float64"), (512, 512, 512, "float32"),
         (512, 512, 512, "float64"), (1024, 1024, 1024, "float32"), (2048, 2048, 2048, "float32"),
         (1, 4096, 4096, "float32"), (4096, 1024, 33, "float32"), (64, 1024, 1024, "float32")]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant, changes in VARIANTS.items():
        saved = {name: getattr(cpu_schedule, name) for name in changes}
        try:
            for name, value in changes.items():
                setattr(cpu_schedule, name, value)
            for m, k, n, dtype in SIZES:
                name = f"linear_{m}x{k}x{n}_{dtype}_cpu_{variant}"
                hexir.export(lambda x, w: hexir.linear(x, w), out / f"{name}.hxb", hexir.TensorSpec((m, k), dtype),
                             hexir.TensorSpec((k, n), dtype), target="cpu:x86-64-v4")
                rows.append({"name": name, "m": m, "k": k, "n": n, "dtype": dtype, "device": "cpu",
                             "variant": variant})
        finally:
            for name, value in saved.items():
                setattr(cpu_schedule, name, value)
    (out / "modules.json").write_text(json.dumps(rows, indent=1))
    print(f"built {len(rows)} modules in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
