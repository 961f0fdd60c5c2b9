// attention_simt: the CUDA-core attention kernel behind both attention ops' float32 path and their
// *_simt twins. One warp per (query token, head); each lane owns head_dim / 32 channels; keys are
// visited one at a time with an online softmax. Simple enough to check by reading, slow on long
// contexts (no K/V reuse across query heads or tokens). An int8 cache (params.kv_dtype) is read with its
// kv_scales, every dtype of q.
#pragma once

#include <cuda_runtime_api.h>

#include "context_attention.h"
#include "inflight/kernels/scalar_type.h"

namespace inflight::kernels::cuda {

// params.cu_seqlens == nullptr selects the decode layout (token i is sequence i's only query, at
// position kv_lens[i] - 1); otherwise the context layout of context_attention.h. params.window as there.
cudaError_t launch_attention_simt(ContextAttentionParams const& params, cudaStream_t stream);

}  // namespace inflight::kernels::cuda
