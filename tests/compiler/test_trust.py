"""Compiler-side hardening (issue 12): the user's own errors while tracing point at their line
with a hint, and a custom kernel whose source does not take what its call passes is a compile
error naming the kernel, never a corrupted heap at run time."""

from __future__ import annotations

import numpy as np
import pytest

import hexir

W = np.ones((8, 4), np.float32)


def _trace_error(fn, *specs) -> hexir.TraceError:
    with pytest.raises(hexir.TraceError) as caught:
        hexir.jit(fn).compile(*(specs or (hexir.TensorSpec((2, 8), "float32"),)))
    return caught.value


@pytest.mark.parametrize(("body", "message"), [
    (lambda x: hexir.linear(x.reshape(2, 2, 4).T, W), r"\.T of rank 3 on a traced .* use x\.transpose"),
    (lambda x: x.reshape(5), r"reshape: cannot reshape float32\[2, 8\] to \[5\]: the sizes cannot match"),
    (lambda x: x[x], "indexing with a tensor is not supported: .* hexir.take"),
])
def test_using_a_tensor_as_something_it_is_not_names_the_op_to_use(body, message):
    error = _trace_error(body)
    assert error.where.startswith(f"{__file__}:")
    assert error.where.endswith(f":{body.__code__.co_firstlineno}")
    assert __import__("re").search(message, error.message), error.message


def test_an_exception_in_the_users_code_is_reraised_at_their_line():
    def model(x):
        hexir.linear(x, W)
        return {}["missing"]  # the line
    error = _trace_error(model)
    assert error.where == f"{__file__}:{model.__code__.co_firstlineno + 2}"
    assert error.message == "test_an_exception_in_the_users_code_is_reraised_at_their_line.<locals>.model " \
                            "raised KeyError while it was traced: 'missing'"
    assert error.source == 'return {}["missing"]  # the line'


def test_returning_a_number_blames_the_function_not_the_caller():
    def three(x):
        return 3
    error = _trace_error(three)
    assert error.where == f"{__file__}:{three.__code__.co_firstlineno}"
    assert "output 0 is a int" in error.message


@pytest.mark.parametrize("shape", [(2**62, 8), (2**63, 8), (2**40, 2**40)])
def test_a_shape_whose_bytes_overflow_is_refused_before_mlir_sees_it(shape):
    with pytest.raises(hexir.TraceError, match="more than 2\\^63 bytes"):
        hexir.TensorSpec(shape, "float32")


DOUBLE_KERNEL = """#include <stdint.h>
void scale2(const double *x, double *y, int64_t r, int64_t c, int64_t r2, int64_t c2) {
    for (int64_t i = 0; i < r * c; ++i) y[i] = 2 * x[i];
}
"""


def _scale2(path, **options):
    return hexir.kernel("scale2", cpu=path, out=lambda x: hexir.TensorSpec(x.shape, x.dtype), **options)


def test_a_c_kernel_for_double_called_on_float32_is_a_compile_error(tmp_path):
    (tmp_path / "scale2.c").write_text(DOUBLE_KERNEL)
    kernel = _scale2(tmp_path / "scale2.c")
    with pytest.raises(hexir.CompileError, match=r"custom kernel scale2: expected void scale2\(const float \*, "
                                                 r"float \*, int64_t, int64_t, int64_t, int64_t\)"):
        hexir.jit(lambda x: kernel(x)).compile(hexir.TensorSpec((2, 3), "float32"))
    module = hexir.jit(lambda x: kernel(x))  # called on float64, the same file is right
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(module(x), 2 * x)


def test_a_prebuilt_kernel_must_declare_its_dtypes_and_calls_must_match(tmp_path):
    (tmp_path / "scale2.c").write_text(DOUBLE_KERNEL)
    built = tmp_path / "scale2.o"
    import subprocess
    subprocess.run(["cc", "-c", "-fPIC", str(tmp_path / "scale2.c"), "-o", str(built)], check=True)
    with pytest.raises(hexir.TraceError, match="is prebuilt, so its argument types cannot be checked: declare"):
        _scale2(built)
    with pytest.raises(hexir.TraceError, match="dtypes= must list float32/float64"):
        _scale2(built, dtypes=("float64",))
    kernel = _scale2(built, dtypes=("float64", "float64"))
    with pytest.raises(hexir.TraceError, match=r"declared dtypes=\('float64', 'float64'\), but this call passes "
                                               r"float32\[2, 3\]"):
        hexir.jit(lambda x: kernel(x)).compile(hexir.TensorSpec((2, 3), "float32"))
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(hexir.jit(lambda x: kernel(x))(x), 2 * x)


# --- issue 28: what the compiler links loads without running code, and records its level ----------


def test_a_prebuilt_library_with_a_constructor_is_refused_at_export(tmp_path):
    import subprocess
    (tmp_path / "scale2.c").write_text(DOUBLE_KERNEL)
    built = tmp_path / "scale2.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(tmp_path / "scale2.c"), "-o", str(built)], check=True)  # start files
    kernel = _scale2(built, dtypes=("float64", "float64"))
    with pytest.raises(hexir.CompileError, match=rf"^custom kernel scale2: {built} has a constructor \(DT_INIT\): a "
                                                 r"library must run no code when it is loaded \(link it with "
                                                 r"-nostartfiles.*; the runtime would refuse it$"):
        hexir.jit(lambda x: kernel(x)).compile(hexir.TensorSpec((2, 3), "float64"))


def test_c_code_with_a_constructor_is_refused_when_the_library_is_linked(tmp_path):
    (tmp_path / "scale2.c").write_text(DOUBLE_KERNEL + "volatile int greeted;\n"
                                       "__attribute__((constructor)) static void hello(void) { greeted = 1; }\n")
    kernel = _scale2(tmp_path / "scale2.c")
    with pytest.raises(hexir.CompileError, match=r"^the cpu library for x86-64(-v\d)? has constructors "
                                                 r"\(DT_INIT_ARRAY\): .*; the runtime would refuse it$"):
        hexir.jit(lambda x: kernel(x)).compile(hexir.TensorSpec((2, 3), "float64"))


def test_each_library_records_its_level_and_loads_without_running_code(tmp_path):
    import hexir_runtime
    from hexir_runtime import elf
    from hexir_runtime import format as hxb

    path = tmp_path / "m.hxb"
    hexir.export(lambda x: hexir.relu(hexir.linear(x, W)), path, hexir.TensorSpec(("batch", 8), "float32"))
    module = hxb.read(path)
    for i, build in enumerate(module.manifest.cpu.libraries):
        library = bytes(module.blob(build.library))
        elf.check_dynamic(library, f"cpu.libraries[{i}].library", build.cpu)  # no error
        start = library.index(b'{"kernels"')
        _, record = hxb.parse_table(library[start : library.index(b"\0", start)], build.cpu)
        assert record == {"cpu": build.cpu, "features": list(build.features)}
    x = np.ones((3, 8), np.float32)
    np.testing.assert_array_equal(hexir_runtime.load(path, "cpu").main(x), np.maximum(x @ W, 0))
