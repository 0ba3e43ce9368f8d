/* Weight-only int8 / int4 GEMM on the bf16 dot-product unit (AVX512_BF16 ``vdpbf16ps``, fp32
 * accumulation): the weights dequantized to exact bf16 integers, a chunk at a time
 * (panel_gemm_wonly.h has the design). For bf16 x (float32 x is rounded to bf16 as it is packed). */
#define WONLY_BF16 1
#include "panel_gemm_wonly.h"
