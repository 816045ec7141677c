"""The CUDA C source of tiled causal attention (FlashAttention's algorithm, flash.py's xp
code as kernels): forward with the online softmax, backward in two kernels; for whole
sequences and for ring attention's pieces (minidist/cp/ring.py).

Dimensions: BH = batch * heads, hs head size (<= HS_MAX = 128); queries (BH, Tq, hs) at
global positions q_start.., keys and values (BH, Tk, hs) at k_start.. (a whole sequence: Tq =
Tk = T, both starts 0), lse and D (BH, Tq) in the accumulation type A. Causal by global
position: key k_start + j is masked for query q_start + i when it comes later. Tiles of FT
queries and FT keys forward, BT backward (16 and 8 for float A, 8 and 4 for double, so every
kernel's static shared memory stays near 32 KiB, under the 48 KiB a block gets without
opting in). Tiles wholly in the causal future are never visited; the diagonal tile and the
tail beyond Tq, Tk are masked.

    flash_fwd        block (query tile, bh): m, l per row (online softmax), acc = sum p v,
                     y = acc / l, lse = m + log l; a row that sees no key of the piece
                     (ring attention: a query before every key held) y = 0, lse = -inf
                     (l = 0; a tile no key reaches returns at once); a NaN or inf score
                     makes l NaN: y NaN, as flash.py's (not 0: an overflow stays visible)
    flash_bwd_dot    D_i = g_i . y_i per row (sum_j P_ij dP_ij, as attention.py)
    flash_bwd_dkdv   block (key tile, bh): over the query tiles from the first that sees it,
                     p = exp(s - lse), ds = p (g v^T - D) scale; dv += p^T g, dk += ds^T q
    flash_bwd_dq     block (query tile, bh): over the key tiles up to the diagonal, dq += ds k
The backward kernels read a piece at row offsets of whole arrays (qo of Lq rows per head,
ko of Lk) and either write its gradients or add them in (`add`): the ring adds each held
block's pieces into dq and into the block's travelling dk, dv, with the merged lse and D of
the whole attention.
Dropout on the weights (flash.py's AttnDropout; dprob > 0): each weight's keep is
dropout_keys.py's Philox number at its place in the whole row (batch-head bh is batch row
drows[bh / nh], head h0 + bh % nh of the whole model's heads, query and key their global
positions in a sequence of dT), computed where the weight is:
the forward's online softmax sums the undropped p and accumulates p Z v (Z = keep / (1 - p));
the backward's tile takes ds = p (Z g v^T - D) and dv from p Z. No mask is stored. The
step is read on the device, dcount[0] - dlag (DropoutKeys.device_step: the count of steps,
advanced there, less how far the forward being redrawn lies behind it), so a captured CUDA
graph draws each replay's own masks.
dq and dk/dv are two kernels (the scores recomputed in each) so no block adds into
another's rows: no atomics, and the same sums in the same order on every run.
They were written and proven on the CPU (tests/test_cuda_flash_cpu.py, the ring's pieces
tests/test_cuda_ring_cpu.py) and have not run on a GPU: cuda_kernels uses them only with
MINIDIST_CUDA_NEW_KERNELS=1.
"""

FLASH = r"""
#define HS_MAX 128
#define FT (64 / (int)sizeof(A))          // forward tile: 16 queries x 16 keys (8 for double)
#define BT (FT / 2)                       // backward tile

__device__ __forceinline__ A neg_inf() { A z = 0; return (A)-1 / z; }

// dropout's factor for weight (i, j) of batch-head bh, i and j global positions: dscale
// (1 / (1 - p)) where dropout_keys.py's number at flat ((h0 + bh % nh) dT + i) dT + j of
// global row drows[bh / nh] (dT: the whole sequence) is >= dprob, else 0 (PHILOX_DEVICE's
// philox_number, cuda_source_philox.py)
__device__ __forceinline__ A dropout_z(long long bh, long long i, long long j,
                                       const long long* drows, long long nh, long long h0,
                                       long long dT, long long dstep, long long dk0,
                                       long long dk1, float dprob, A dscale) {
    long long flat = ((h0 + bh % nh) * dT + i) * dT + j;
    return philox_number(flat, drows[bh / nh], dstep, dk0, dk1) >= dprob ? dscale : (A)0;
}

// `rows` rows of hs values from row r0 of src (a head's piece, n rows) into dst (A), times
// mul; rows past n are zeros
__device__ void load_tile(A* dst, const T* src, long long r0, int rows, long long n, int hs,
                          A mul) {
    for (int e = threadIdx.x; e < rows * hs; e += blockDim.x) {
        long long r = r0 + e / hs;
        dst[e] = r < n ? ld(src, r * hs + e % hs) * mul : (A)0;
    }
}

// how many keys of a piece (Tk keys from global position k_start) some query up to local
// row r_last (global q_start + r_last) sees: the key tiles to visit are those below it
__device__ __forceinline__ long long keys_seen(long long r_last, long long q_start,
                                               long long Tk, long long k_start) {
    long long n = q_start + r_last - k_start + 1;
    return n < Tk ? n : Tk;
}

extern "C" __global__ void flash_fwd(const T* q, const T* k, const T* v, T* y, A* lse,
                                     long long Tq, long long q_start, long long Tk,
                                     long long k_start, int hs, A scale,
                                     const long long* drows, long long nh, long long h0,
                                     long long dT, const long long* dcount, long long dlag,
                                     long long dk0, long long dk1, float dprob, A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A qs[FT * HS_MAX], ks[FT * HS_MAX], vs[FT * HS_MAX], acc[FT * HS_MAX];
    __shared__ A s[FT][FT + 1], m[FT], l[FT], alpha[FT];
    long long qh = blockIdx.y * Tq * hs, kh = blockIdx.y * Tk * hs;   // this head's rows
    long long r0 = (long long)blockIdx.x * FT;
    long long c_end = keys_seen((r0 + FT < Tq ? r0 + FT : Tq) - 1, q_start, Tk, k_start);
    if (c_end <= 0) {          // no row of the tile sees a key (ring attention's pieces): y 0,
        for (int e = threadIdx.x; e < FT * hs; e += blockDim.x)     // lse -inf, written with
            if (r0 + e / hs < Tq) st(y, qh + r0 * hs + e, (A)0);    // no shared memory (m and
        if (threadIdx.x < FT && r0 + threadIdx.x < Tq)              // l would be read before
            lse[blockIdx.y * Tq + r0 + threadIdx.x] = neg_inf();    // a barrier: none comes)
        return;                                                     // the whole block
    }
    load_tile(qs, q + qh, r0, FT, Tq, hs, scale);              // q pre-scaled
    for (int e = threadIdx.x; e < FT * hs; e += blockDim.x) acc[e] = 0;
    if (threadIdx.x < FT) { m[threadIdx.x] = neg_inf(); l[threadIdx.x] = 0; }
    for (long long c0 = 0; c0 < c_end; c0 += FT) {             // key tiles to the diagonal
        __syncthreads();                // the last tile's readers of ks, vs, s are done
        load_tile(ks, k + kh, c0, FT, Tk, hs, 1);
        load_tile(vs, v + kh, c0, FT, Tk, hs, 1);
        __syncthreads();
        for (int e = threadIdx.x; e < FT * FT; e += blockDim.x) {   // s = q k^T, masked
            int r = e / FT, c = e % FT;
            A d = 0;
            for (int x = 0; x < hs; x++) d += qs[r * hs + x] * ks[c * hs + x];
            s[r][c] = k_start + c0 + c > q_start + r0 + r || c0 + c >= Tk ? neg_inf() : d;
        }
        __syncthreads();
        if (threadIdx.x < FT) {          // online softmax, a thread per row; a row sees key 0
            int r = threadIdx.x;         // of the piece if it sees any, so from tile 0 on
            A mx = m[r], sum = 0;        // its max is finite or it never sees a key
            for (int c = 0; c < FT; c++) mx = s[r][c] > mx ? s[r][c] : mx;
            A mref = mx == neg_inf() ? (A)0 : mx;    // no key (yet): every p = exp(-inf) = 0
            for (int c = 0; c < FT; c++) {
                A p = ex(s[r][c] - mref);
                sum += p;                // l sums the undropped p; acc takes p Z (dropout)
                long long i = r0 + r, j = c0 + c;
                if (dprob > 0 && k_start + j <= q_start + i && i < Tq && j < Tk)
                    p *= dropout_z(blockIdx.y, q_start + i, k_start + j, drows, nh, h0, dT,
                                   dstep, dk0, dk1, dprob, dscale);
                s[r][c] = p;
            }
            alpha[r] = ex(m[r] - mref);  // rescales the old sums; 0 on the first tile
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
        if (r0 + e / hs < Tq) {                                 // l: settled. A row that saw
            A lr = l[e / hs];                                   // no key (l 0): y 0, lse -inf;
            st(y, qh + r0 * hs + e, lr == (A)0 ? (A)0 : acc[e] / lr);   // l nan: y nan
        }
    if (threadIdx.x < FT && r0 + threadIdx.x < Tq) {
        A lr = l[threadIdx.x];
        lse[blockIdx.y * Tq + r0 + threadIdx.x] = lr > 0 ? m[threadIdx.x] + lg(lr) : neg_inf();
    }
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

// p (times dropout's Z) and ds of one (BT queries from local row r0) x (BT keys from c0)
// tile of batch-head bh; 0 where masked (key after query, by global position) or past the
// piece (Tq queries from q_start, Tk keys from k_start); lse, D: the piece's rows
__device__ void bwd_tile(A (*p)[BT + 1], A (*ds)[BT + 1], const A* qs, const A* ks,
                         const A* gs, const A* vs, const A* lse, const A* D, long long r0,
                         long long c0, long long Tq, long long q_start, long long Tk,
                         long long k_start, int hs, A scale, long long bh,
                         const long long* drows, long long nh, long long h0, long long dT,
                         long long dstep, long long dk0, long long dk1, float dprob,
                         A dscale) {
    for (int e = threadIdx.x; e < BT * BT; e += blockDim.x) {
        int r = e / BT, c = e % BT;
        long long i = r0 + r, j = c0 + c;
        A pv = 0, dsv = 0;
        if (k_start + j <= q_start + i && i < Tq && j < Tk) {
            A sd = 0, dp = 0;
            for (int x = 0; x < hs; x++) {
                sd += qs[r * hs + x] * ks[c * hs + x];
                dp += gs[r * hs + x] * vs[c * hs + x];
            }
            pv = ex(sd * scale - lse[i]);                // the forward's probability
            A z = dprob > 0 ? dropout_z(bh, q_start + i, k_start + j, drows, nh, h0, dT,
                                        dstep, dk0, dk1, dprob, dscale) : (A)1;  // y = (p Z) v
            dsv = pv * (dp * z - D[i]) * scale;          // softmax backward, then the scale
            pv *= z;                                     // dv takes p Z
        }
        p[r][c] = pv;
        ds[r][c] = dsv;
    }
}

// Both backward kernels work on a piece: queries rows qo .. qo+Tq-1 of q's Lq rows per head
// (q, g, lse, D and dq alike), at global positions q_start..; keys rows ko .. ko+Tk-1 of k's
// Lk rows per head (k, v, dk and dv alike), at k_start..; the whole sequence is Lq = Tq =
// Lk = Tk = T with offsets and starts 0. add: 1 adds the piece's gradients into dq (dk, dv),
// 0 writes them.
extern "C" __global__ void flash_bwd_dkdv(const T* q, const T* k, const T* v, const T* g,
                                          const A* lse, const A* D, T* dk, T* dv,
                                          long long Lq, long long qo, long long Tq,
                                          long long q_start, long long Lk, long long ko,
                                          long long Tk, long long k_start, int add, int hs,
                                          A scale, const long long* drows, long long nh,
                                          long long h0, long long dT, const long long* dcount,
                                          long long dlag, long long dk0, long long dk1,
                                          float dprob, A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A ks[BT * HS_MAX], vs[BT * HS_MAX], dks[BT * HS_MAX], dvs[BT * HS_MAX];
    __shared__ A qs[BT * HS_MAX], gs[BT * HS_MAX], p[BT][BT + 1], ds[BT][BT + 1];
    long long qh = (blockIdx.y * Lq + qo) * hs, kh = (blockIdx.y * Lk + ko) * hs;
    long long c0 = (long long)blockIdx.x * BT;
    const A *lse_h = lse + blockIdx.y * Lq + qo, *D_h = D + blockIdx.y * Lq + qo;
    long long r_first = k_start + c0 - q_start;                 // the first query to see c0
    load_tile(ks, k + kh, c0, BT, Tk, hs, 1);
    load_tile(vs, v + kh, c0, BT, Tk, hs, 1);
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) dks[e] = dvs[e] = 0;
    for (long long r0 = r_first > 0 ? r_first : 0; r0 < Tq; r0 += BT) {  // from the diagonal
        __syncthreads();                 // the last tile's readers of qs, gs, p, ds are done
        load_tile(qs, q + qh, r0, BT, Tq, hs, 1);
        load_tile(gs, g + qh, r0, BT, Tq, hs, 1);
        __syncthreads();
        bwd_tile(p, ds, qs, ks, gs, vs, lse_h, D_h, r0, c0, Tq, q_start, Tk, k_start, hs,
                 scale, blockIdx.y, drows, nh, h0, dT, dstep, dk0, dk1, dprob, dscale);
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
        if (c0 + e / hs < Tk) {                                 // no barrier needed
            long long at = kh + c0 * hs + e;
            st(dk, at, add ? ld(dk, at) + dks[e] : dks[e]);
            st(dv, at, add ? ld(dv, at) + dvs[e] : dvs[e]);
        }
}

extern "C" __global__ void flash_bwd_dq(const T* q, const T* k, const T* v, const T* g,
                                        const A* lse, const A* D, T* dq, long long Lq,
                                        long long qo, long long Tq, long long q_start,
                                        long long Lk, long long ko, long long Tk,
                                        long long k_start, int add, int hs, A scale,
                                        const long long* drows, long long nh, long long h0,
                                        long long dT, const long long* dcount, long long dlag,
                                        long long dk0, long long dk1, float dprob,
                                        A dscale) {
    const long long dstep = dprob > 0 ? dcount[0] - dlag : 0;     // the masks' step
    __shared__ A qs[BT * HS_MAX], gs[BT * HS_MAX], dqs[BT * HS_MAX];
    __shared__ A ks[BT * HS_MAX], vs[BT * HS_MAX], p[BT][BT + 1], ds[BT][BT + 1];
    long long qh = (blockIdx.y * Lq + qo) * hs, kh = (blockIdx.y * Lk + ko) * hs;
    long long r0 = (long long)blockIdx.x * BT;
    long long c_end = keys_seen((r0 + BT < Tq ? r0 + BT : Tq) - 1, q_start, Tk, k_start);
    load_tile(qs, q + qh, r0, BT, Tq, hs, 1);
    load_tile(gs, g + qh, r0, BT, Tq, hs, 1);
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) dqs[e] = 0;
    for (long long c0 = 0; c0 < c_end; c0 += BT) {              // key tiles to the diagonal
        __syncthreads();
        load_tile(ks, k + kh, c0, BT, Tk, hs, 1);
        load_tile(vs, v + kh, c0, BT, Tk, hs, 1);
        __syncthreads();
        bwd_tile(p, ds, qs, ks, gs, vs, lse + blockIdx.y * Lq + qo, D + blockIdx.y * Lq + qo,
                 r0, c0, Tq, q_start, Tk, k_start, hs, scale, blockIdx.y, drows, nh, h0, dT,
                 dstep, dk0, dk1, dprob, dscale);
        __syncthreads();
        for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) {   // dq += ds k
            int r = e / hs, d = e % hs;
            A a = dqs[e];
            for (int c = 0; c < BT; c++) a += ds[r][c] * ks[c * hs + d];
            dqs[e] = a;
        }
    }
    for (int e = threadIdx.x; e < BT * hs; e += blockDim.x)
        if (r0 + e / hs < Tq) {
            long long at = qh + r0 * hs + e;
            st(dq, at, add ? ld(dq, at) + dqs[e] : dqs[e]);
        }
}
"""

FLASH_NAMES = ("flash_fwd", "flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq")
HS_MAX = 128
THREADS = 128


def tiles(acc_itemsize):
    """(forward tile, backward tile) for an accumulation type of this many bytes."""
    ft = 64 // acc_itemsize
    return ft, ft // 2
