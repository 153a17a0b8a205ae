"""Experiment (run on the H200, needs cupy): the FP64 tensor-core instructions' fragment layouts
and throughputs, to choose the shape the DMMA kernel issues (schedules/cuda.py).

    python bench/dmma_shapes.py

For each shape of `mma.sync ... .f64`: checks, against numpy, the fragment layout the kernel
assumes (A[g + 8 r, t + 4 j], B[t + 4 j, g], C[g + 8 r, 2 t + h]; g = lane / 4, t = lane % 4),
then times a grid of warps doing nothing but independent mma's and prints TFLOP/s.
"""

import cupy as cp
import numpy as np

#: (m, n, k): A holds m*k/32 f64 per thread, B k*n/32, C m*n/32.
SHAPES = [(8, 8, 4), (16, 8, 4), (16, 8, 8), (16, 8, 16)]


def source(m: int, n: int, k: int, chains: int) -> str:
    na, nb, nc = m * k // 32, k * n // 32, m * n // 32

    def regs(count: int, start: int) -> str:
        return ", ".join(f"%{start + i}" for i in range(count))
    operands = f"{{{regs(nc, 0)}}}, {{{regs(na, nc)}}}, {{{regs(nb, nc + na)}}}, {{{regs(nc, 0)}}}"
    asm = (f'asm volatile("mma.sync.aligned.m{m}n{n}k{k}.row.col.f64.f64.f64.f64 {operands};" : '
           + ", ".join(f'"+d"(c[CH][{i}])' for i in range(nc)) + " : "
           + ", ".join([f'"d"(a[{i}])' for i in range(na)] + [f'"d"(b[{i}])' for i in range(nb)]) + ");")
    body = "\n".join(asm.replace("CH", str(ch)) for ch in range(chains))
    return f"""
extern "C" __global__ void check(const double* A, const double* B, double* C) {{
    int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    double a[{na}], b[{nb}], c[1][{nc}];
    for (int i = 0; i < {na}; ++i) a[i] = A[(g + 8 * (i % 2) * ({m} / 16)) * {k} + t + 4 * ({m} == 16 ? i / 2 : i)];
    for (int i = 0; i < {nb}; ++i) b[i] = B[(t + 4 * i) * {n} + g];
    for (int i = 0; i < {nc}; ++i) c[0][i] = 0.0;
    {asm.replace("CH", "0")}
    for (int i = 0; i < {nc}; ++i) C[(g + 8 * (i / 2)) * {n} + 2 * t + i % 2] = c[0][i];
}}
extern "C" __global__ void spin(double* out, int iterations) {{
    double a[{na}], b[{nb}], c[{chains}][{nc}];
    for (int i = 0; i < {na}; ++i) a[i] = threadIdx.x * 1e-3 + i;
    for (int i = 0; i < {nb}; ++i) b[i] = threadIdx.x * 2e-3 + i;
    for (int ch = 0; ch < {chains}; ++ch) for (int i = 0; i < {nc}; ++i) c[ch][i] = 0.0;
    for (int it = 0; it < iterations; ++it) {{
{body}
    }}
    double s = 0.0;
    for (int ch = 0; ch < {chains}; ++ch) for (int i = 0; i < {nc}; ++i) s += c[ch][i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
"""


def main() -> None:
    rng = np.random.default_rng(0)
    properties = cp.cuda.runtime.getDeviceProperties(0)
    print(properties["name"].decode(), "SMs", properties["multiProcessorCount"])
    for m, n, k in SHAPES:
        module = cp.RawModule(code=source(m, n, k, 8), options=("-arch=sm_90",))
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        c = cp.zeros((m, n))
        module.get_function("check")((1,), (32,), (cp.asarray(a), cp.asarray(b), c))
        error = float(np.abs(c.get() - a @ b).max())
        spin = module.get_function("spin")
        blocks, threads, iterations = 132 * 16, 128, 2000
        out = cp.zeros(blocks * threads)
        spin((blocks,), (threads,), (out, np.int32(iterations)))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        spin((blocks,), (threads,), (out, np.int32(iterations)))
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop)
        flops = 2 * m * n * k * 8 * iterations * blocks * threads / 32
        print(f"m{m}n{n}k{k}: layout max error {error:.1e}; {flops / ms / 1e9:.1f} TFLOP/s")


if __name__ == "__main__":
    main()
