"""The CUDA C source of tiled causal attention (FlashAttention's algorithm, flash.py's xp
code as kernels): forward with the online softmax, backward in two kernels.

Dimensions: BH = batch * heads, T sequence, hs head size (<= HS_MAX = 128); q, k, v, y, g
(BH, T, hs) contiguous, lse and D (BH, T) in the accumulation type A. Tiles of FT queries
and FT keys forward, BT backward (16 and 8 for float A, 8 and 4 for double, so every
kernel's static shared memory stays near 32 KiB, under the 48 KiB a block gets without
opting in). Tiles wholly in the causal future are never visited; the diagonal tile and the
tail beyond T are masked.

    flash_fwd        block (query tile, bh): m, l per row (online softmax), acc = sum p v,
                     y = acc / l, lse = m + log l
    flash_bwd_dot    D_i = g_i . y_i per row (sum_j P_ij dP_ij, as attention.py)
    flash_bwd_dkdv   block (key tile, bh): over the query tiles from the diagonal on,
                     p = exp(s - lse), ds = p (g v^T - D) scale; dv += p^T g, dk += ds^T q
    flash_bwd_dq     block (query tile, bh): over the key tiles up to the diagonal, dq += ds k
Dropout on the weights (flash.py's AttnDropout; dprob > 0): each weight's keep is
dropout_keys.py's Philox number at its place in the whole row (batch-head bh is batch row
drows[bh / nh], head h0 + bh % nh of the whole model's heads), computed where the weight is:
the forward's online softmax sums the undropped p and accumulates p Z v (Z = keep / (1 - p));
the backward's tile takes ds = p (Z g v^T - D) and dv from p Z. No mask is stored. The
step is read on the device, dcount[0] - dlag (DropoutKeys.device_step: the count of steps,
advanced there, less how far the forward being redrawn lies behind it), so a captured CUDA
graph draws each replay's own masks.
dq and dk/dv are two kernels (the scores recomputed in each) so no block adds into
another's rows: no atomics, and the same sums in the same order on every run.
They were written and proven on the CPU (tests/test_cuda_flash_cpu.py) and have not run on a
GPU: cuda_kernels uses them only with MINIDIST_CUDA_NEW_KERNELS=1.
"""

FLASH = r"""
#define HS_MAX 128
#define FT (64 / (int)sizeof(A))          // forward tile: 16 queries x 16 keys (8 for double)
#define BT (FT / 2)                       // backward tile

__device__ __forceinline__ A neg_inf() { A z = 0; return (A)-1 / z; }

// dropout's factor for weight (i, j) of batch-head bh: dscale (1 / (1 - p)) where
// dropout_keys.py's number at flat ((h0 + bh % nh) T + i) T + j of global row
// drows[bh / nh] is >= dprob, else 0 (PHILOX_DEVICE's philox_number, cuda_source_philox.py)
__device__ __forceinline__ A dropout_z(long long bh, long long i, long long j, long long T_,
                                       const long long* drows, long long nh, long long h0,
                                       long long dstep, long long dk0, long long dk1,
                                       float dprob, A dscale) {
    long long flat = ((h0 + bh % nh) * T_ + i) * T_ + j;
    return philox_number(flat, drows[bh / nh], dstep, dk0, dk1) >= dprob ? dscale : (A)0;
}

// `rows` rows of hs values from row r0 of src (a head's (T, hs) block) into dst (A), times
// mul; rows past T are zeros
__device__ void load_tile(A* dst, const T* src, long long r0, int rows, long long T_,
                          int hs, A mul) {
    for (int e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        long long r = r0 + e / hs;
        dst[e] = r < T_ ? ld(src, r * hs + e % hs) * mul : (A)0;
    }
}

extern "C" __global__ void flash_fwd(const T* q, const T* k, const T* v, T* y, A* lse,
                                     long long T_, int hs, A scale, const long long* drows,
                                     long long nh, long long h0, const long long* dcount,
                                     long long dlag, long long dk0, long long dk1, float dprob,
                                     A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A qs[FT * HS_MAX], ks[FT * HS_MAX], vs[FT * HS_MAX], acc[FT * HS_MAX];
    __shared__ A s[FT][FT + 1], m[FT], l[FT], alpha[FT];
    long long head = blockIdx.y * T_ * hs, r0 = (long long)blockIdx.x * FT;
    long long r_end = r0 + FT < T_ ? r0 + FT : T_;
    load_tile(qs, q + head, r0, FT, T_, hs, scale);            // q pre-scaled
    for (int e = threadIdx.x; e < FT * hs; e += blockDim.x) acc[e] = 0;
    if (threadIdx.x < FT) { m[threadIdx.x] = neg_inf(); l[threadIdx.x] = 0; }
    for (long long c0 = 0; c0 < r_end; c0 += FT) {             // key tiles to the diagonal
        __syncthreads();                // the last tile's readers of ks, vs, s are done
        load_tile(ks, k + head, c0, FT, T_, hs, 1);
        load_tile(vs, v + head, c0, FT, T_, hs, 1);
        __syncthreads();
        for (int e = threadIdx.x; e < FT * FT; e += blockDim.x) {   // s = q k^T, masked
            int r = e / FT, c = e % FT;
            A d = 0;
            for (int x = 0; x < hs; x++) d += qs[r * hs + x] * ks[c * hs + x];
            s[r][c] = c0 + c > r0 + r || c0 + c >= T_ ? neg_inf() : d;
        }
        __syncthreads();
        if (threadIdx.x < FT) {          // online softmax, a thread per row: key c0 <= row,
            int r = threadIdx.x;         // so every row has a finite max from tile 0 on
            A mx = m[r], sum = 0;
            for (int c = 0; c < FT; c++) mx = s[r][c] > mx ? s[r][c] : mx;
            for (int c = 0; c < FT; c++) {
                A p = ex(s[r][c] - mx);
                sum += p;                // l sums the undropped p; acc takes p Z (dropout)
                long long i = r0 + r, j = c0 + c;
                if (dprob > 0 && j <= i && i < T_)
                    p *= dropout_z(blockIdx.y, i, j, T_, drows, nh, h0, dstep, dk0, dk1, dprob,
                                   dscale);
                s[r][c] = p;
            }
            alpha[r] = ex(m[r] - mx);    // rescales the old sums; 0 on the first tile
            l[r] = l[r] * alpha[r] + sum;
            m[r] = mx;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < FT * hs; e += blockDim.x) {   // acc = alpha acc + p v
            int r = e / hs, d = e % hs;
            A a = acc[e] * alpha[r];
            for (int c = 0; c < FT; c++) a += s[r][c] * vs[c * hs + d];
            acc[e] = a;
        }
    }
    for (int e = threadIdx.x; e < FT * hs; e += blockDim.x)    // each thread its own acc[e];
        if (r0 + e / hs < T_) st(y, head + r0 * hs + e, acc[e] / l[e / hs]);   // l: settled
    if (threadIdx.x < FT && r0 + threadIdx.x < T_)
        lse[blockIdx.y * T_ + r0 + threadIdx.x] = m[threadIdx.x] + lg(l[threadIdx.x]);
}

extern "C" __global__ void flash_bwd_dot(const T* g, const T* y, A* D, long long rows,
                                         int hs) {
    for (long long r = blockIdx.x * (long long)blockDim.x + threadIdx.x; r < rows;
         r += (long long)gridDim.x * blockDim.x) {
        A s = 0;
        for (int d = 0; d < hs; d++) s += ld(g, r * hs + d) * ld(y, r * hs + d);
        D[r] = s;
    }
}

// p (times dropout's Z) and ds of one (BT queries from r0) x (BT keys from c0) tile of
// batch-head bh; 0 where masked or past T
__device__ void bwd_tile(A (*p)[BT + 1], A (*ds)[BT + 1], const A* qs, const A* ks,
                         const A* gs, const A* vs, const A* lse, const A* D, long long r0,
                         long long c0, long long T_, int hs, A scale, long long bh,
                         const long long* drows, long long nh, long long h0, long long dstep,
                         long long dk0, long long dk1, float dprob, A dscale) {
    for (int e = threadIdx.x; e < BT * BT; e += blockDim.x) {
        int r = e / BT, c = e % BT;
        long long i = r0 + r, j = c0 + c;
        A pv = 0, dsv = 0;
        if (j <= i && i < T_) {
            A sd = 0, dp = 0;
            for (int x = 0; x < hs; x++) {
                sd += qs[r * hs + x] * ks[c * hs + x];
                dp += gs[r * hs + x] * vs[c * hs + x];
            }
            pv = ex(sd * scale - lse[i]);                // the forward's probability
            A z = dprob > 0 ? dropout_z(bh, i, j, T_, drows, nh, h0, dstep, dk0, dk1, dprob,
                                        dscale) : (A)1;  // y = (p Z) v
            dsv = pv * (dp * z - D[i]) * scale;          // softmax backward, then the scale
            pv *= z;                                     // dv takes p Z
        }
        p[r][c] = pv;
        ds[r][c] = dsv;
    }
}

extern "C" __global__ void flash_bwd_dkdv(const T* q, const T* k, const T* v, const T* g,
                                          const A* lse, const A* D, T* dk, T* dv,
                                          long long T_, int hs, A scale,
                                          const long long* drows, long long nh, long long h0,
                                          const long long* dcount, long long dlag,
                                          long long dk0, long long dk1, float dprob,
                                          A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A ks[BT * HS_MAX], vs[BT * HS_MAX], dks[BT * HS_MAX], dvs[BT * HS_MAX];
    __shared__ A qs[BT * HS_MAX], gs[BT * HS_MAX], p[BT][BT + 1], ds[BT][BT + 1];
    long long head = blockIdx.y * T_ * hs, c0 = (long long)blockIdx.x * BT;
    const A *lse_h = lse + blockIdx.y * T_, *D_h = D + blockIdx.y * T_;
    load_tile(ks, k + head, c0, BT, T_, hs, 1);
    load_tile(vs, v + head, c0, BT, T_, hs, 1);
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) dks[e] = dvs[e] = 0;
    for (long long r0 = c0; r0 < T_; r0 += BT) {     // query tiles from the diagonal on
        __syncthreads();                 // the last tile's readers of qs, gs, p, ds are done
        load_tile(qs, q + head, r0, BT, T_, hs, 1);
        load_tile(gs, g + head, r0, BT, T_, hs, 1);
        __syncthreads();
        bwd_tile(p, ds, qs, ks, gs, vs, lse_h, D_h, r0, c0, T_, hs, scale, blockIdx.y, drows,
                 nh, h0, dstep, dk0, dk1, dprob, dscale);
        __syncthreads();
        for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) {   // dv += p^T g, dk += ds^T q
            int c = e / hs, d = e % hs;
            A a = dvs[e], b = dks[e];
            for (int r = 0; r < BT; r++) {
                a += p[r][c] * gs[r * hs + d];
                b += ds[r][c] * qs[r * hs + d];
            }
            dvs[e] = a;
            dks[e] = b;
        }
    }
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x)    // each thread its own e:
        if (c0 + e / hs < T_) {                                 // no barrier needed
            st(dk, head + c0 * hs + e, dks[e]);
            st(dv, head + c0 * hs + e, dvs[e]);
        }
}

extern "C" __global__ void flash_bwd_dq(const T* q, const T* k, const T* v, const T* g,
                                        const A* lse, const A* D, T* dq, long long T_,
                                        int hs, A scale, const long long* drows,
                                        long long nh, long long h0, const long long* dcount,
                                        long long dlag, long long dk0, long long dk1,
                                        float dprob, A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A qs[BT * HS_MAX], gs[BT * HS_MAX], dqs[BT * HS_MAX];
    __shared__ A ks[BT * HS_MAX], vs[BT * HS_MAX], p[BT][BT + 1], ds[BT][BT + 1];
    long long head = blockIdx.y * T_ * hs, r0 = (long long)blockIdx.x * BT;
    long long r_end = r0 + BT < T_ ? r0 + BT : T_;
    load_tile(qs, q + head, r0, BT, T_, hs, 1);
    load_tile(gs, g + head, r0, BT, T_, hs, 1);
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) dqs[e] = 0;
    for (long long c0 = 0; c0 < r_end; c0 += BT) {              // key tiles to the diagonal
        __syncthreads();
        load_tile(ks, k + head, c0, BT, T_, hs, 1);
        load_tile(vs, v + head, c0, BT, T_, hs, 1);
        __syncthreads();
        bwd_tile(p, ds, qs, ks, gs, vs, lse + blockIdx.y * T_, D + blockIdx.y * T_, r0, c0,
                 T_, hs, scale, blockIdx.y, drows, nh, h0, dstep, dk0, dk1, dprob, dscale);
        __syncthreads();
        for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) {   // dq += ds k
            int r = e / hs, d = e % hs;
            A a = dqs[e];
            for (int c = 0; c < BT; c++) a += ds[r][c] * ks[c * hs + d];
            dqs[e] = a;
        }
    }
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x)
        if (r0 + e / hs < T_) st(dq, head + r0 * hs + e, dqs[e]);
}
"""

FLASH_NAMES = ("flash_fwd", "flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq")
HS_MAX = 128
THREADS = 128


def tiles(acc_itemsize):
    """(forward tile, backward tile) for an accumulation type of this many bytes."""
    ft = 64 // acc_itemsize
    return ft, ft // 2
