// The AVX-512 (+ BF16 build) instance of the tiled strategy: gemm_tiled_impl.h.
#include "gemm_avx512.h"
#include "gemm_tiled_impl.h"
