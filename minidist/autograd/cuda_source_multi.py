"""The CUDA C source of the multi-tensor optimizer kernels (minidist/optim/multi_tensor.py
plans them): ONE launch over many tensors, the optimizer's launches per step no longer
growing with the number of parameters.

A launch is handed tables instead of arrays: for each role (parameter, gradient, m, v, ...)
a device array of the tensors' addresses (uint64, one per tensor), their sizes, and per
block which tensor it works on (blk_tensor) and where its chunk starts (blk_start): block b
walks elements [blk_start[b], min(blk_start[b] + chunk, sizes[t])) of tensor t =
blk_tensor[b], its threads striding by blockDim.x. The same idea as apex's
multi_tensor_apply and PyTorch's fused AdamW (learned from, not copied).

    multi_adamw          AdamW in place over every tensor of a parameter group (T float or
                         double): per element adamw_step's arithmetic, line for line and in
                         its order (cuda_source.py), so the result is bitwise the
                         per-parameter kernel's
    multi_amp_adamw      --amp's step: 16-bit gradients (T = __half or __nv_bfloat16)
                         widened and multiplied by the step's factor (1/S, times the clip
                         factor), AdamW on the float32 master, m and v, then the master
                         rounded to nearest even into the 16-bit model weight: what
                         MasterWeightOptimizer.step does per parameter (amp.unscaled, then
                         adamw_update, then p.data[...] = master)
    multi_scale          the clip's multiply: every gradient times a factor read on the device
                         (float32 and float64 gradients; bitwise clip.py's per-gradient
                         multiply)
    multi_sum_sq         the clip's sum of squares of (widened gradient x scale), one partial
    multi_sum_sq_final   per block, then one block sums the partials: deterministic (no
                         float atomics), accumulated in A (float32; float64 for double)

Proven on the CPU only (tests/test_multi_tensor_cpu.py: the harness hands the kernel tables
of its own guarded copies of the tensors); never run on a GPU. Kept in a part of its own so
an unproven kernel cannot break the proven ones' compilation.
"""

MULTI = r"""
// The element range of this block: tensor *t, elements [*start, *end)
__device__ __forceinline__ void multi_chunk(const long long* sizes, const int* blk_tensor,
                                            const long long* blk_start, long long chunk,
                                            int* t, long long* start, long long* end) {
    *t = blk_tensor[blockIdx.x];
    *start = blk_start[blockIdx.x];
    *end = min(*start + chunk, sizes[*t]);
}

extern "C" __global__ void multi_adamw(const unsigned long long* p_tab,
                                       const unsigned long long* g_tab,
                                       const unsigned long long* m_tab,
                                       const unsigned long long* v_tab,
                                       const long long* sizes, const int* blk_tensor,
                                       const long long* blk_start, long long chunk, A b1,
                                       A one_minus_b1, A b2, A one_minus_b2, A decay,
                                       A inv_sqrt_bc2, A eps, A step_size) {
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    T* p = (T*)p_tab[t];
    const T* g = (const T*)g_tab[t];
    T* m = (T*)m_tab[t];
    T* v = (T*)v_tab[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        A gi = ld(g, i), pi = ld(p, i) * decay;           // adamw_step's body, unchanged
        A mi = ld(m, i) * b1 + gi * one_minus_b1;
        A vi = ld(v, i) * b2 + gi * gi * one_minus_b2;
        st(m, i, mi);
        st(v, i, vi);
        st(p, i, pi - mi / (sqrt(vi) * inv_sqrt_bc2 + eps) * step_size);
    }
}

// w: the 16-bit model weights (T), g: their 16-bit gradients; p, m, v: float32
extern "C" __global__ void multi_amp_adamw(const unsigned long long* w_tab,
                                           const unsigned long long* g_tab,
                                           const unsigned long long* p_tab,
                                           const unsigned long long* m_tab,
                                           const unsigned long long* v_tab,
                                           const long long* sizes, const int* blk_tensor,
                                           const long long* blk_start, long long chunk,
                                           float factor, float b1, float one_minus_b1,
                                           float b2, float one_minus_b2, float decay,
                                           float inv_sqrt_bc2, float eps, float step_size) {
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    T* w = (T*)w_tab[t];
    const T* g = (const T*)g_tab[t];
    float* p = (float*)p_tab[t];
    float* m = (float*)m_tab[t];
    float* v = (float*)v_tab[t];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = ld(g, i) * factor, pi = p[i] * decay;  // amp.unscaled, then adamw_step
        float mi = m[i] * b1 + gi * one_minus_b1;
        float vi = v[i] * b2 + gi * gi * one_minus_b2;
        float pn = pi - mi / (sqrt(vi) * inv_sqrt_bc2 + eps) * step_size;
        m[i] = mi;
        v[i] = vi;
        p[i] = pn;
        st(w, i, pn);                                     // rounded to nearest even
    }
}

// g *= factor in place, factor read on the device (the clip's 0-d float64 array: no host
// read) and rounded to T's accumulation type first, as clip.py's `g *= scale.astype(T)`
extern "C" __global__ void multi_scale(const unsigned long long* g_tab, const long long* sizes,
                                       const int* blk_tensor, const long long* blk_start,
                                       long long chunk, const double* factor) {
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    T* g = (T*)g_tab[t];
    A f = (A)factor[0];
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) st(g, i, ld(g, i) * f);
}

// partial[b] = sum over block b's chunk of (g * scale)^2
extern "C" __global__ void multi_sum_sq(const unsigned long long* g_tab, const long long* sizes,
                                        const int* blk_tensor, const long long* blk_start,
                                        long long chunk, A scale, A* partial) {
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    const T* g = (const T*)g_tab[t];
    A s = 0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        A x = ld(g, i) * scale;
        s += x * x;
    }
    s = block_reduce(s, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// out[0] = the sum of n partials, by one block, in a fixed order
extern "C" __global__ void multi_sum_sq_final(const A* partial, long long n, A* out) {
    A s = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
    s = block_reduce(s, false);
    if (threadIdx.x == 0) out[0] = s;
}
"""

MULTI_NAMES = ("multi_adamw", "multi_amp_adamw", "multi_scale", "multi_sum_sq",
               "multi_sum_sq_final")
