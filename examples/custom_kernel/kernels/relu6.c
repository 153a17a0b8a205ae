/* relu6 for the CPU: the same contract as kernels/relu6.cu (docs/custom-kernels.md). */
#include <stdint.h>

void relu6(const float *x, float *y, int64_t x_rows, int64_t x_cols, int64_t y_rows, int64_t y_cols) {
    (void)y_rows;
    (void)y_cols;
    for (int64_t i = 0; i < x_rows * x_cols; ++i) {
        float v = x[i] < 0.0f ? 0.0f : x[i];
        y[i] = v > 6.0f ? 6.0f : v;
    }
}
