// relu6 for CUDA: y = min(max(x, 0), 6), one thread per element.
// The dims of every argument follow the pointers (docs/custom-kernels.md).
extern "C" __global__ void relu6(const float *x, float *y, long long x_rows, long long x_cols,
                                 long long y_rows, long long y_cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_rows * x_cols) y[i] = fminf(fmaxf(x[i], 0.0f), 6.0f);
}
