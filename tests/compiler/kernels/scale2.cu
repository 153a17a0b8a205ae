extern "C" __global__ void scale2(const float *x, float *out, long long x_rows, long long x_cols,
                                  long long out_rows, long long out_cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_rows * x_cols) out[i] = 2.0f * x[i] + (float)(out_rows * out_cols);
}
