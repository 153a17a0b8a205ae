/* out = 2 * x + (number of elements, from the dims): checks pointers and dims both arrive. */
#include <stdint.h>

void scale2(const float *x, float *out, int64_t x_rows, int64_t x_cols, int64_t out_rows, int64_t out_cols) {
    int64_t n = x_rows * x_cols;
    for (int64_t i = 0; i < n; ++i) out[i] = 2.0f * x[i] + (float)(out_rows * out_cols);
}
