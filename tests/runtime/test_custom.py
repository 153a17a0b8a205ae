"""Custom kernels (docs/custom-kernels.md): user C code called once with its pointers, then every
dimension of every argument as int64s, from the module's library or a shared object of its own;
the format's rules for them; the reference device's refusal; `hexir-run --info`.

The CUDA side (kernelParams, fatbin images) is in test_cuda.py, with the fake driver.
"""

from __future__ import annotations

import copy
import platform

import numpy as np
import pytest
from hexir_runtime import DeviceError, HxbFormatError, KernelError, load
from hexir_runtime import cpu as cpu_device
from hexir_runtime import format as hxb
from hexir_runtime.cli import main as hexir_run
from hexir_runtime.cpu import check_library

# Linked into the module's library with the generated kernels, as hexir does with a .c file.
RELU6 = """
void relu6(const float *x, float *y, int64_t x_rows, int64_t x_cols, int64_t y_rows, int64_t y_cols) {
  for (int64_t i = 0; i < y_rows * y_cols; ++i) {
    float v = x[i] < 0 ? 0 : x[i];
    y[i] = v > 6 ? 6 : v;
  }
}
"""

# A prebuilt shared object of its own (a `library` blob), as hexir embeds a .so.
OPS = """
/* out[i, j] = h[i, j] * scale[j]: float32 and float64 arguments mix */
void scale_columns(const float *h, const double *scale, double *out,
                   int64_t h_rows, int64_t h_cols, int64_t scale_size, int64_t out_rows, int64_t out_cols) {
  for (int64_t i = 0; i < out_rows; ++i)
    for (int64_t j = 0; j < out_cols && j < scale_size; ++j) out[i * out_cols + j] = h[i * h_cols + j] * scale[j];
}

/* out = [its scalars..., c + the last element of x]; c is rank 0, so it adds no scalar */
void echo_dims(const float *x, const double *c, double *out, int64_t a, int64_t b, int64_t d, int64_t n) {
  out[0] = a; out[1] = b; out[2] = d; out[3] = n;
  out[4] = *c + x[a * b * d - 1];
}

/* four inputs, the most a custom kernel takes */
void add4(const float *a, const double *b, const float *c, const double *d, double *out,
          int64_t na, int64_t nb, int64_t nc, int64_t nd, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i] + c[i] + d[i];
}
"""

SCALE = np.linspace(-2, 2, 16)
C = np.array(0.25)
ROW, SCALED, OUT64 = ([2, 16], "float32"), ([16], "float64"), ([2, 16], "float64")
FAKE_SO = b"\x7fELF not a library"


@pytest.fixture(scope="module")
def libraries(modules, compile_c) -> tuple[bytes, bytes]:
    """The module's library (every generated test kernel, and relu6) and the separate ops.so."""
    builder = modules.Builder()
    builder.custom("relu6", [ROW, ROW])
    table = modules.table_c(modules.standard_kernels() + builder.kernels)
    return compile_c(modules.kernels_code + RELU6 + table, "module_with_relu6"), compile_c(OPS, "ops")


def cpu_module(modules, module_library: bytes = FAKE_SO, ops_library: bytes = FAKE_SO):
    """Kernels: 0 linear_bias (generated), 1 relu6 (custom, module library), 2 scale_columns,
    3 echo_dims and 4 add4 (custom, in ops.so, blob 4). Entries:
    `main(x: float32[2, 8]) -> scale_columns(relu6(x @ W1 + b1), SCALE)`,
    `dims(x: float32[2, 3, 4]) -> echo_dims(x, C)` and `add(a, b, c, d) -> a + b + c + d`."""
    builder, weights = modules.Builder(), modules.weights()
    w1, b1 = builder.constant("W1", weights["W1"]), builder.constant("b1", weights["b1"])
    scale, c = builder.constant("scale", SCALE), builder.constant("c", C)
    ops = builder.blob("ops.so", ops_library)
    layer = builder.kernel("linear_bias", [[2, 8], [8, 16], [16], [2, 16]])
    relu6 = builder.custom("relu6", [ROW, ROW])
    scale_columns = builder.custom("scale_columns", [ROW, SCALED, OUT64], library=ops, source="ops.so")
    echo = builder.custom("echo_dims", [([2, 3, 4], "float32"), ([], "float64"), ([5], "float64")], library=ops,
                          source="ops.so")
    add4 = builder.custom("add4", [([3], "float32"), ([3], "float64")] * 2 + [([3], "float64")], library=ops,
                          source="ops.so")
    entry = builder.entry()
    x = entry.input("x", [2, 8])
    hidden = entry.call(relu6, entry.call(layer, x, entry.constant(w1), entry.constant(b1)))
    entry.ret(entry.call(scale_columns, hidden, entry.constant(scale)))
    entry = builder.entry("dims")
    entry.ret(entry.call(echo, entry.input("x", [2, 3, 4]), entry.constant(c)))
    entry = builder.entry("add")
    inputs = [entry.input(name, [3], dtype) for name, dtype in zip("abcd", ["float32", "float64"] * 2, strict=True)]
    entry.ret(entry.call(add4, *inputs))
    return builder.build(module_library)


def gpu_module(modules, module_library: bytes = FAKE_SO, ops_library: bytes = FAKE_SO):
    """`main(x: float32[2, 16]) -> scale_columns(relu6(x), SCALE)`, both custom CUDA kernels (a
    fatbin, blob 0) whose cpu fallbacks are relu6 in the module library and scale_columns in
    ops.so (blob 1)."""
    builder = modules.Builder()
    fatbin, ops = builder.blob("kernels.fatbin", b"\x50\xed\x55\xba fatbin"), builder.blob("ops.so", ops_library)
    scale = builder.constant("scale", SCALE)
    relu6 = builder.custom("relu6", [ROW, ROW], "cuda", images={"fatbin": fatbin},
                           cpu_fallback={"symbol": "relu6", "source": "relu6.c"})
    scale_columns = builder.custom("scale_columns", [ROW, SCALED, OUT64], "cuda", source="ops.cu",
                                   images={"fatbin": fatbin},
                                   cpu_fallback={"symbol": "scale_columns", "source": "ops.so", "library": ops})
    entry = builder.entry()
    on_gpu = entry.transfer(entry.input("x", [2, 16]), "cuda")
    result = entry.call(scale_columns, entry.call(relu6, on_gpu), entry.constant(scale, "cuda"))
    entry.ret(entry.transfer(result, "cpu"))
    return builder.build(module_library)


def x_of(shape, dtype="float32", seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 4).astype(dtype)


# --- running on the cpu -----------------------------------------------------------------------


def test_custom_kernels_run_between_generated_ones(modules, libraries):
    module = load(hxb.encode(*cpu_module(modules, *libraries)), "cpu")
    weights = modules.weights()
    x = x_of((2, 8))
    y = module.main(x)
    hidden = np.clip(x @ weights["W1"] + weights["b1"], 0, 6)
    assert y.dtype == np.float64 and 0 < (hidden == 6).sum() < hidden.size  # relu6 clipped some, not all
    np.testing.assert_allclose(y, hidden.astype(np.float64) * SCALE, rtol=1e-5, atol=1e-5)


def test_the_scalars_are_every_dimension_of_every_arg_in_order(modules, libraries):
    module = load(hxb.encode(*cpu_module(modules, *libraries)), "cpu")
    x = x_of((2, 3, 4))
    assert module.dims(x).tolist() == [2, 3, 4, 5, C + x[-1, -1, -1]]
    a, b, c, d = (x_of(3, dtype, seed) for seed, dtype in enumerate(["float32", "float64"] * 2))
    np.testing.assert_allclose(module.add(a, b, c, d), a.astype(np.float64) + b + c + d, rtol=1e-15)


def test_a_library_blob_is_loaded_once(modules, libraries, monkeypatch):
    monkeypatch.setattr(cpu_device, "_libraries", {})
    data = hxb.encode(*cpu_module(modules, *libraries))
    load(data, "cpu")  # three kernels use ops.so
    loaded = dict(cpu_device._libraries)
    assert len(loaded) == 2
    load(data, "cpu")
    assert cpu_device._libraries == loaded  # the same library objects, by sha256


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_custom_cuda_kernels_run_as_their_cpu_fallbacks(modules, libraries, no_gpu, device):
    module = load(hxb.encode(*gpu_module(modules, *libraries)), device)
    assert module.device_name == "cpu"
    x = x_of((2, 16))
    np.testing.assert_allclose(module.main(x), np.clip(x, 0, 6).astype(np.float64) * SCALE, rtol=1e-15)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_custom_cuda_kernel_without_fallback_needs_a_gpu(modules, no_gpu, device):
    manifest, blobs = gpu_module(modules)
    del manifest["kernels"][1]["cpu_fallback"]
    with pytest.raises(DeviceError, match=r"^kernels\[1\] \(k1_scale_columns\) runs on cuda and has no cpu_fallback: "
                                          r"run this module with --device=cuda on a GPU \(a custom kernel has no "
                                          r"numpy version for --device=reference\)$"):
        load(hxb.encode(manifest, blobs), device)


def test_a_missing_custom_symbol_names_its_library(modules, libraries):
    manifest, blobs = cpu_module(modules, *libraries)
    manifest["kernels"][2]["symbol"] = "nope"
    with pytest.raises(KernelError, match=r"^kernels\[2\] \(k2_scale_columns\): symbol 'nope' is not in its "
                                          r"library \(blob 4, ops\.so\)$"):
        load(hxb.encode(manifest, blobs), "cpu")
    manifest["kernels"][2]["symbol"], manifest["kernels"][1]["symbol"] = "scale_columns", "relu7"
    with pytest.raises(HxbFormatError, match=r"^kernels\[1\].symbol: k1_relu6: symbol 'relu7' is not in the "
                                             r"kernel table of the CPU library for generic \(blob 5\)$"):
        load(hxb.encode(manifest, blobs), "cpu")


def test_a_library_that_cannot_be_loaded_is_named(modules, libraries, compile_c):
    with pytest.raises(HxbFormatError, match=r"^kernels\[2\]\.library: kernels\[2\] \(k2_scale_columns\): its library "
                                             r"\(blob 4, ops\.so\) is not a 64-bit little-endian ELF shared object$"):
        load(hxb.encode(*cpu_module(modules, libraries[0], FAKE_SO)), "cpu")  # refused before dlopen sees it
    unresolved = compile_c("int missing(void);\nint use(void) { return missing(); }\n", "unresolved")
    message = r"^cannot load the library of kernels\[2\] \(k2_scale_columns\) \(blob 4\): .*undefined symbol: missing"
    with pytest.raises(DeviceError, match=message):
        load(hxb.encode(*cpu_module(modules, libraries[0], unresolved)), "cpu")


def test_a_library_for_another_architecture_is_refused(modules, libraries):
    module_library, ops_library = libraries
    here = platform.machine()
    other = (183, "aarch64") if cpu_device._arch(here) != "aarch64" else (62, "x86_64")
    foreign = ops_library[:18] + other[0].to_bytes(2, "little") + ops_library[20:]  # ELF e_machine
    with pytest.raises(DeviceError, match=rf"^kernels\[2\] \(k2_scale_columns\): its library \(blob 4, ops\.so\) "
                                          rf"is for {other[1]}, but this machine is {here}$"):
        load(hxb.encode(*cpu_module(modules, module_library, foreign)), "cpu")


def test_check_library_reads_the_elf_machine(libraries):
    _, ops_library = libraries
    check_library(memoryview(ops_library), "ops.so")
    check_library(memoryview(ops_library), "ops.so", machine=platform.machine().upper())
    with pytest.raises(DeviceError, match=r"^ops\.so is for \w+, but this machine is sparc64$"):
        check_library(memoryview(ops_library), "ops.so", machine="sparc64")
    with pytest.raises(HxbFormatError, match=r"^kernels\[2\]\.library: not an ELF is not a 64-bit little-endian ELF "):
        check_library(memoryview(FAKE_SO), "not an ELF", machine="sparc64", field="kernels[2].library")


# --- the reference device and hexir-run ---------------------------------------------------------

REFUSAL = "kernels[1] (k1_relu6) is a custom kernel: the reference device has no numpy version of it"


def test_the_reference_device_refuses_custom_kernels_when_loading(modules):
    with pytest.raises(KernelError) as error:
        load(hxb.encode(*cpu_module(modules)), "reference")
    assert str(error.value) == REFUSAL
    with pytest.raises(KernelError, match=r"^kernels\[0\] \(k0_relu6\) is a custom kernel"):
        load(hxb.encode(*gpu_module(modules)), "reference")


def test_hexir_run_on_the_reference_device_fails_before_running(modules, tmp_path, capsys):
    hxb.write(tmp_path / "custom.hxb", *cpu_module(modules))
    np.save(tmp_path / "x.npy", x_of((2, 8)))
    code = hexir_run([str(tmp_path / "custom.hxb"), "--device=reference", "--input", f"x={tmp_path / 'x.npy'}"])
    assert (code, *capsys.readouterr()) == (1, "", f"hexir-run: {REFUSAL}\n")


def test_info_lists_custom_kernels_their_sources_and_libraries(modules, tmp_path, capsys):
    hxb.write(tmp_path / "cpu.hxb", *cpu_module(modules))
    hxb.write(tmp_path / "gpu.hxb", *gpu_module(modules))
    assert hexir_run([str(tmp_path / "cpu.hxb"), "--info"]) == 0
    out = capsys.readouterr().out
    for line in ["  [0] k0_linear_bias: cpu linear(", "      symbol linear_bias_2x8_8x16_16_2x16_float32, "
                 "work extent 2\n",
                 "  [1] k1_relu6: cpu custom(read float32[2, 16], write float32[2, 16])\n"
                 "      symbol relu6, in the cpu library\n      source relu6.c, scalars [2, 16, 2, 16]\n",
                 "  [2] k2_scale_columns: cpu custom(read float32[2, 16], read float64[16], write float64[2, 16])\n"
                 "      symbol scale_columns, library in blob 4\n      source ops.so, scalars [2, 16, 16, 2, 16]\n",
                 "  [3] k3_echo_dims: cpu custom(read float32[2, 3, 4], read float64[], write float64[5])",
                 "%4 = call k1_relu6(%3)", "  [4] ops.so: 18 bytes at"]:
        assert line in out, line
    assert hexir_run([str(tmp_path / "gpu.hxb"), "--info"]) == 0
    out = capsys.readouterr().out
    assert ("  [0] k0_relu6: cuda custom(read float32[2, 16], write float32[2, 16])\n"
            "      symbol relu6, grid [1, 1, 1], block [256, 1, 1], shared 0 bytes\n"
            "      source relu6.cu, scalars [2, 16, 2, 16]\n"
            "      images: fatbin in blob 0\n"
            "      cpu fallback: relu6, from relu6.c, in the cpu library\n") in out
    assert "      cpu fallback: scale_columns, from ops.so, library in blob 1\n" in out


# --- the format's rules for custom kernels ------------------------------------------------------


def _drop(container, key):
    del container[key]


CPU_MUTATIONS = {  # mutation of cpu_module()'s manifest -> (field, part of the message)
    "one arg": (lambda m: m["kernels"][1]["args"].pop(0), "kernels[1].args",
                "custom takes 2 to 5 args (1 to 4 inputs, then out), got 1"),
    "six args": (lambda m: m["kernels"][4]["args"].insert(0, dict(m["kernels"][4]["args"][0])), "kernels[4].args",
                 "got 6"),
    "write access": (lambda m: m["kernels"][2]["args"][1].update(access="write"), "kernels[2].args[1].access",
                     "expected one of read"),
    "no scalars": (lambda m: _drop(m["kernels"][1], "scalars"), "kernels[1].scalars",
                   "missing (custom kernels need it)"),
    "scalars out of order": (lambda m: m["kernels"][2].update(scalars=[2, 16, 2, 16, 16]), "kernels[2].scalars",
                             "expected the dimensions of every arg in order, [2, 16, 16, 2, 16], "
                             "got [2, 16, 2, 16, 16]"),
    "scalars short": (lambda m: m["kernels"][3]["scalars"].pop(), "kernels[3].scalars", "[2, 3, 4, 5], got [2, 3, 4]"),
    "negative scalar": (lambda m: m["kernels"][1]["scalars"].__setitem__(0, -2), "kernels[1].scalars[0]",
                        "expected an integer >= 0, got -2"),
    "float scalar": (lambda m: m["kernels"][1]["scalars"].__setitem__(0, 2.0), "kernels[1].scalars[0]", "got 2.0"),
    "scalars not a list": (lambda m: m["kernels"][1].update(scalars=4), "kernels[1].scalars", "expected an array"),
    "scalars on a generated kernel": (lambda m: m["kernels"][0].update(scalars=[2, 8]), "kernels[0].scalars",
                                      "only custom kernels have this key"),
    "no source": (lambda m: _drop(m["kernels"][2], "source"), "kernels[2].source", "missing (custom kernels need it)"),
    "empty source": (lambda m: m["kernels"][1].update(source=""), "kernels[1].source",
                     "expected a file name (a non-empty string), got ''"),
    "source not a string": (lambda m: m["kernels"][1].update(source=["relu6.c"]), "kernels[1].source", "got an array"),
    "source on a generated kernel": (lambda m: m["kernels"][0].update(source="linear.c"), "kernels[0].source",
                                     "only custom kernels have this key"),
    "work on a custom kernel": (lambda m: m["kernels"][1].update(work={"extent": 2, "grain": 1}),
                                "kernels[1].work", "only generated cpu kernels have this key"),
    "sizes on a custom kernel": (lambda m: m["kernels"][1].update(sizes=[]), "kernels[1].sizes",
                                 "only generated kernels have this key"),
    "library on a generated kernel": (lambda m: m["kernels"][0].update(library=4), "kernels[0].library",
                                      "only custom cpu kernels have this key"),
    "library index": (lambda m: m["kernels"][2].update(library=9), "kernels[2].library", "blob index in [0, 6), got 9"),
    "launch on a cpu kernel": (lambda m: m["kernels"][1].update(launch={}), "kernels[1].launch",
                               "only cuda kernels have this key"),
    "cpu section missing": (lambda m: _drop(m, "cpu"), "cpu", "missing, but kernels[0] has cpu code and no library"),
}

GPU_MUTATIONS = {  # mutation of gpu_module()'s manifest -> (field, part of the message)
    "image name": (lambda m: m["kernels"][0].update(images={"cubin": 0}), "kernels[0].images.cubin",
                   "expected sm_<number> (CUBIN), compute_<number> (PTX), either with an a suffix (sm_90a), or fatbin"),
    "fatbin blob": (lambda m: m["kernels"][0]["images"].update(fatbin=7), "kernels[0].images.fatbin", "blob index"),
    "no launch": (lambda m: _drop(m["kernels"][0], "launch"), "kernels[0].launch", "missing (cuda kernels need it)"),
    "no images": (lambda m: _drop(m["kernels"][1], "images"), "kernels[1].images", "missing (cuda kernels need it)"),
    "no scalars": (lambda m: _drop(m["kernels"][1], "scalars"), "kernels[1].scalars", "missing (custom kernels"),
    "scalars": (lambda m: m["kernels"][0].update(scalars=[2, 16]), "kernels[0].scalars", "[2, 16, 2, 16], got [2, 16]"),
    "library outside the fallback": (lambda m: m["kernels"][1].update(library=1), "kernels[1].library",
                                     "only custom cpu kernels have this key"),
    "generated fallback keys": (lambda m: m["kernels"][0]["cpu_fallback"].update(work={"extent": 2, "grain": 1}),
                                "kernels[0].cpu_fallback.work",
                                "unknown key (allowed: symbol, source, library)"),
    "fallback without source": (lambda m: _drop(m["kernels"][0]["cpu_fallback"], "source"),
                                "kernels[0].cpu_fallback.source", "missing"),
    "fallback empty source": (lambda m: m["kernels"][1]["cpu_fallback"].update(source=""),
                              "kernels[1].cpu_fallback.source", "non-empty string"),
    "fallback library": (lambda m: m["kernels"][1]["cpu_fallback"].update(library=-1),
                         "kernels[1].cpu_fallback.library", "blob index"),
    "fallback symbol": (lambda m: m["kernels"][1]["cpu_fallback"].update(symbol="scale columns"),
                        "kernels[1].cpu_fallback.symbol", "identifier"),
    "cpu section unneeded": (lambda m: m["kernels"][0]["cpu_fallback"].update(library=1), "cpu",
                             "present, but no kernel has cpu code in a cpu library"),
}


def assert_rule(parts, mutate, field: str, text: str) -> None:
    manifest = copy.deepcopy(parts[0])
    mutate(manifest)
    with pytest.raises(HxbFormatError) as caught:
        hxb.encode(manifest, parts[1])
    assert caught.value.field == field, str(caught.value)
    assert text in caught.value.reason, str(caught.value)


@pytest.mark.parametrize("name", CPU_MUTATIONS)
def test_cpu_custom_kernel_rule(modules, name):
    assert_rule(cpu_module(modules), *CPU_MUTATIONS[name])


@pytest.mark.parametrize("name", GPU_MUTATIONS)
def test_cuda_custom_kernel_rule(modules, name):
    assert_rule(gpu_module(modules), *GPU_MUTATIONS[name])


def test_generated_kernels_keep_their_rules(modules):
    parts = modules.cuda()
    assert_rule(parts, lambda m: m["kernels"][0]["images"].update(fatbin=0), "kernels[0].images.fatbin",
                "only custom kernels have a fatbin image")
    assert_rule(parts, lambda m: m["kernels"][0]["cpu_fallback"].update(source="relu.c"),
                "kernels[0].cpu_fallback.source", "unknown key (allowed: symbol, work)")
    assert_rule(parts, lambda m: m["kernels"][0]["args"][0].update(dtype="int32"), "kernels[0].args[0].dtype",
                "(int64 is only a reduce's argmax output), got 'int32'")


def test_what_custom_kernels_may_do(modules):
    """Mixed dtypes, rank-0 args, no scalars at all, and a module whose cpu code is all in library
    blobs of its own, without a cpu section."""
    builder = modules.Builder()
    ops, fatbin = builder.blob("ops.so", FAKE_SO), builder.blob("twice.fatbin", b"fatbin")
    scalar = builder.custom("negate", [([], "float64"), ([], "float32")], library=ops)
    fallback = {"symbol": "twice", "source": "ops.so", "library": ops}
    gpu = builder.custom("twice", [([], "float32"), ([], "float32")], "cuda",
                         images={"fatbin": fatbin, "sm_90": fatbin}, cpu_fallback=fallback)
    entry = builder.entry()
    on_cpu = entry.call(scalar, entry.input("x", [], "float64"))
    entry.ret(entry.transfer(entry.call(gpu, entry.transfer(on_cpu, "cuda")), "cpu"))
    parts = builder.build()
    manifest = hxb.decode(hxb.encode(*parts)).manifest
    assert manifest.cpu is None and manifest.kernels[0].integers == ()
    assert_rule(parts, lambda m: _drop(m["kernels"][1]["cpu_fallback"], "library"), "cpu",
                "missing, but kernels[1] has cpu code and no library of its own")
    assert_rule(parts, lambda m: m.update(cpu={"arch": "x86_64", "cpu": "x86-64", "features": [], "library": 0}),
                "cpu", "present, but no kernel has cpu code in a cpu library")
