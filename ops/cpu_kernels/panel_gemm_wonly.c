/* Weight-only int8 / int4 GEMM on float32 FMAs (AVX-512F): the weights dequantized to exact float32
 * integers in registers, a chunk at a time (panel_gemm_wonly.h has the design). float32 x runs here
 * unrounded; bf16 x is widened exactly. */
#include "panel_gemm_wonly.h"
