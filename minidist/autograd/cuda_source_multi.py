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
    multi_amp_adamw_dev  the same, reading the factor and the step's scalars from the device
                         array amp_verdict fills, and doing nothing on an overflow
    multi_amp_adamw_g32  the two above over float32 gradients (--grad-dtype float32: the
    multi_amp_adamw_dev_g32  16-bit weights' gradients accumulated and reduced in float32);
                         the same arithmetic, the gradient read as a float
    amp_verdict          one thread: --amp's overflow verdict, the loss scale's rules and
                         AdamW's step count, kept on the device (no host read a step;
                         minidist/train/master_weights.py)
    multi_scale          the clip's multiply: every gradient times a factor read on the device
                         (float32 and float64 gradients; bitwise clip.py's per-gradient
                         multiply)
    multi_sum_sq         the clip's sum of squares of (widened gradient x scale), one partial
    multi_sum_sq_final   per block, then one block sums the partials: deterministic (no
                         float atomics), accumulated in A (float32; float64 for double)

Proven on the CPU only (tests/test_multi_tensor_cpu.py, tests/test_device_verdict_cpu.py:
the harness hands the kernel tables of its own guarded copies of the tensors); never run on
a GPU. Kept in a part of its own so
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

// --amp's update of elements [start, end) of one tensor: w, the 16-bit model weights (T), g
// their gradients (G: T, or float under --grad-dtype float32); p, m, v float32. s: factor,
// b1, 1 - b1, b2, 1 - b2, inv_sqrt_bc2, eps, step_size (as a float array, whether from the
// host or the verdict kernel)
template <typename G>
__device__ __forceinline__ void amp_adamw_range(T* w, const G* g, float* p, float* m, float* v,
                                                long long start, long long end, float decay,
                                                const float* s) {
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = ld(g, i) * s[0], pi = p[i] * decay;    // amp.unscaled, then adamw_step
        float mi = m[i] * s[1] + gi * s[2];
        float vi = v[i] * s[3] + gi * gi * s[4];
        float pn = pi - mi / (sqrt(vi) * s[5] + s[6]) * s[7];
        m[i] = mi;
        v[i] = vi;
        p[i] = pn;
        st(w, i, pn);                                     // rounded to nearest even
    }
}

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
    const float s[8] = {factor, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
                        step_size};
    amp_adamw_range((T*)w_tab[t], (const T*)g_tab[t], (float*)p_tab[t], (float*)m_tab[t],
                    (float*)v_tab[t], start, end, decay, s);
}

// multi_amp_adamw over float32 gradients (--grad-dtype float32)
extern "C" __global__ void multi_amp_adamw_g32(const unsigned long long* w_tab,
                                               const unsigned long long* g_tab,
                                               const unsigned long long* p_tab,
                                               const unsigned long long* m_tab,
                                               const unsigned long long* v_tab,
                                               const long long* sizes, const int* blk_tensor,
                                               const long long* blk_start, long long chunk,
                                               float factor, float b1, float one_minus_b1,
                                               float b2, float one_minus_b2, float decay,
                                               float inv_sqrt_bc2, float eps,
                                               float step_size) {
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    const float s[8] = {factor, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
                        step_size};
    amp_adamw_range((T*)w_tab[t], (const float*)g_tab[t], (float*)p_tab[t], (float*)m_tab[t],
                    (float*)v_tab[t], start, end, decay, s);
}

// The same update with the verdict decided on the device (amp_verdict below): verdict[0]
// nonzero skips the step (every block returns); verdict[1..8] are multi_amp_adamw's
// factor .. step_size. decay (1 - lr x weight decay) is the group's, known on the host.
extern "C" __global__ void multi_amp_adamw_dev(const unsigned long long* w_tab,
                                               const unsigned long long* g_tab,
                                               const unsigned long long* p_tab,
                                               const unsigned long long* m_tab,
                                               const unsigned long long* v_tab,
                                               const long long* sizes, const int* blk_tensor,
                                               const long long* blk_start, long long chunk,
                                               float decay, const float* verdict) {
    if (verdict[0] != 0.0f) return;
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    amp_adamw_range((T*)w_tab[t], (const T*)g_tab[t], (float*)p_tab[t], (float*)m_tab[t],
                    (float*)v_tab[t], start, end, decay, verdict + 1);
}

// multi_amp_adamw_dev over float32 gradients (--grad-dtype float32)
extern "C" __global__ void multi_amp_adamw_dev_g32(const unsigned long long* w_tab,
                                                   const unsigned long long* g_tab,
                                                   const unsigned long long* p_tab,
                                                   const unsigned long long* m_tab,
                                                   const unsigned long long* v_tab,
                                                   const long long* sizes,
                                                   const int* blk_tensor,
                                                   const long long* blk_start,
                                                   long long chunk, float decay,
                                                   const float* verdict) {
    if (verdict[0] != 0.0f) return;
    int t;
    long long start, end;
    multi_chunk(sizes, blk_tensor, blk_start, chunk, &t, &start, &end);
    amp_adamw_range((T*)w_tab[t], (const float*)g_tab[t], (float*)p_tab[t], (float*)m_tab[t],
                    (float*)v_tab[t], start, end, decay, verdict + 1);
}

// --amp's overflow verdict and AdamW's step count, decided on the device (one thread), so
// the step needs no host read: LossScaler.unscale_and_clip, verdict and update, line for
// line in double. sum_sq: the global sum of squares of the unscaled gradients (as the host
// verdict's, MixedPrecision.unscaled_sum_sq, every rank's added). state (double, in
// place): loss scale, good steps, skipped, skips in a row, AdamW's step count, the step's
// unscaled norm.
// verdict (float): skip, then multi_amp_adamw's factor .. step_size for the new step count.
// interval <= 0: a fixed scale. max_skips: after that many skips in a row the host verdict
// raises and the run stops; here the state freezes instead (every later step skipped,
// nothing counted) until settle() reads it back and raises as the host would have.
extern "C" __global__ void amp_verdict(const double* sum_sq, double* state, float* verdict,
                                       double max_norm, double growth, double backoff,
                                       double interval, double max_skips, double lr,
                                       double b1, double b2, double eps) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double scale = state[0];
    double s2 = sum_sq[0];
    double norm = sqrt(s2);                    // nan for a nan (or negative) sum, as on the host
    if (state[3] >= max_skips) {               // stopped (LossScaler.check_skips)
        state[5] = norm;
        verdict[0] = 1.0f;
        return;
    }
    bool found_inf = !(norm - norm == 0.0);    // inf - inf and nan - nan are nan: not finite
    double clip = (max_norm > 0.0 && max_norm < norm) ? max_norm / (norm + 1e-6) : 1.0;
    double factor = (found_inf ? 1.0 : clip) / scale;
    if (found_inf) {
        state[1] = 0.0;
        state[2] += 1.0;
        state[3] += 1.0;
        if (interval > 0.0) state[0] = scale * backoff;
    } else {
        state[1] += 1.0;
        state[3] = 0.0;
        state[4] += 1.0;
        if (interval > 0.0 && state[1] >= interval) {
            state[0] = scale * growth;
            state[1] = 0.0;
        }
    }
    state[5] = norm;
    double step = state[4];
    verdict[0] = found_inf ? 1.0f : 0.0f;
    verdict[1] = (float)factor;
    verdict[2] = (float)b1;
    verdict[3] = (float)(1.0 - b1);
    verdict[4] = (float)b2;
    verdict[5] = (float)(1.0 - b2);
    verdict[6] = (float)(1.0 / sqrt(1.0 - pow(b2, step)));
    verdict[7] = (float)eps;
    verdict[8] = (float)(lr / (1.0 - pow(b1, step)));
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

MULTI_NAMES = ("multi_adamw", "multi_amp_adamw", "multi_amp_adamw_dev", "multi_amp_adamw_g32",
               "multi_amp_adamw_dev_g32", "amp_verdict", "multi_scale", "multi_sum_sq",
               "multi_sum_sq_final")
